import sys
from pathlib import Path

import pytest

from prime_mesh import Coordinator

# Spawned node processes import their entry point from mesh_node.py; spawn copies sys.path.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def coordinator(request):
    """An in-process Coordinator on a free loopback port with the test module's TOKEN and
    MIN_NODES, closed when the test ends."""
    c = Coordinator("127.0.0.1", 0, token=request.module.TOKEN,
                    min_nodes=request.module.MIN_NODES).start()  # fmt: skip
    yield c
    c.close()
