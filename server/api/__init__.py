"""One module per API: each is a small object the shared routes drive."""
