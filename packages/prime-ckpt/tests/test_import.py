import prime_ckpt


def test_imports_alone():
    assert prime_ckpt.__version__ == "0.1.0"
