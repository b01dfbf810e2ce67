"""Z-Image-Turbo text-to-image: graph.py draws the walk; family.py builds the components."""
