"""recovery: reconciles what should run on each sled with what does."""
