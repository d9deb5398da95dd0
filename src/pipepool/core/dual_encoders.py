"""The dual encoders' architectures (CLIP, SigLIP, SigLIP2): a text tower and a vision tower in one
folder, each run as a pipeline of its own. Read where torch is not imported yet (the command
line's help reads model folders' names)."""

# The architectures whose checkpoints hold a text and a vision tower.
DUAL_ENCODERS = {"CLIPModel": "clip", "SiglipModel": "siglip", "Siglip2Model": "siglip2"}
# Appended to a dual encoder's architecture for its vision tower's family ("CLIPModel:vision").
VISION_SUFFIX = ":vision"
