"""Multimodal inputs: `media` loads the images a client names (data, file and http(s) URLs) under a MediaPolicy."""
