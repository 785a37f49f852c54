"""storyrl: visual-storytelling metrics as reward functions.

``import storyrl`` stays light (no torch): the heavy libraries are imported by
the rewards and models that need them.
"""

from storyrl.compat import check_earlier_torchvision_import, install_torchvision_hook

__version__ = "0.1.0"

# CPU-only machines may have a torchvision whose compiled ops cannot load; make
# sure pure-PyTorch fallbacks are registered before anyone imports it.
check_earlier_torchvision_import()  # imported too late to prevent it: say what to do
install_torchvision_hook()
