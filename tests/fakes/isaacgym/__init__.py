"""Fake Isaac Gym: only gymdeps' import-order check (the real package refuses to load after torch)."""
import sys

if "torch" in sys.modules:
    raise ImportError("PyTorch was imported before isaacgym modules.  Please import torch "
                      "after isaacgym modules.")

FAKE = True
