"""prime-comm alone: importing it pulls in no other Prime package."""

from prime_testkit.imports import sibling_imports


def test_imports_alone():
    """Importing prime_comm and its submodules imports none of its sibling packages."""
    siblings = sibling_imports("prime_comm")
    assert not siblings, f"importing prime_comm imported {siblings}"
