"""mlx-nursery's engine: a Trio actor graph around mlx-lm's models and batch caches."""
