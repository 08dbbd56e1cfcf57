import sys
from pathlib import Path

# Spawned node processes import their entry point from mesh_node.py; spawn copies sys.path.
sys.path.insert(0, str(Path(__file__).parent))
