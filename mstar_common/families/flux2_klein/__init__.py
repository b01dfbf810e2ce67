"""FLUX.2 [klein] text-to-image and editing: graph.py draws the walk; family.py builds the components."""
