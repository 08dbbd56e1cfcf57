"""Errors of peer transfer; all are PeerError, so one except clause catches every one."""


class PeerError(RuntimeError):
    """A peer transfer that could not complete; the message names the peers and reasons."""


class PeerAuthError(PeerError):
    """A donor refused our requests (wrong run token, clock skew) or answered unsigned."""


class NoPeerError(PeerError):
    """No donor could be reached, or none had a committed checkpoint to offer."""


class PeerGoneError(PeerError):
    """Every donor of the pinned step and digest died or dropped it mid-transfer."""
