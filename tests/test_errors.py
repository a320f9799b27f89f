from tether.errors import TetherError


def test_message_is_one_line():
    err = TetherError("bad thing\nfix it\n  by doing x")
    assert str(err) == "bad thing fix it by doing x"
    assert isinstance(err, Exception)
