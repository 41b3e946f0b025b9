"""mlx-nursery's HTTP front, CLI and load client."""
