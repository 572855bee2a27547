"""Deprecated import path of the wire protocol, kept for code written against it (and the frozen golden-bytes test):
the module is qurl.wire.protocol."""

from qurl.wire.protocol import *  # noqa: F403
