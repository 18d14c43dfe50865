"""What differs per model: architectures, sharding, loading."""
