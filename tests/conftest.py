import os
import sys

# Test modules and the spawned workers they start import the helpers in this folder
# (distributed.py) by name; spawn hands sys.path to the children.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
