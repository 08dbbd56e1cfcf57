"""prime-mesh alone: importing it pulls in no other Prime package."""

from prime_testkit.imports import sibling_imports


def test_imports_alone():
    """Importing prime_mesh and its submodules imports none of its sibling packages."""
    siblings = sibling_imports("prime_mesh")
    assert not siblings, f"importing prime_mesh imported {siblings}"
