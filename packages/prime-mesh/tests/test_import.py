import prime_mesh


def test_imports_alone():
    assert prime_mesh.__version__ == "0.1.0"
