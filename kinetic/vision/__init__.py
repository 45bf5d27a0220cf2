"""Vision: images from requests (images.py) and the projectors (mmproj files) that turn them
into embedding rows of the text model's step."""
