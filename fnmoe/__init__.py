"""fnmoe: functional Mixture-of-Experts training in PyTorch."""
