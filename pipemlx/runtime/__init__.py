"""What runs on a rank at inference time."""
