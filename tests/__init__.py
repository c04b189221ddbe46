"""fedhet test suite: tiny scenarios and models on CPU, never the network."""
