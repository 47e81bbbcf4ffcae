"""Every protocol by name (and form); a new protocol is one file in this package and one line here."""

from __future__ import annotations

from ....errors import KvevictError
from .agnostic import Agnostic
from .aware import Aware
from .base import Protocol
from .multi import MultiAwareRequests, MultiRequests, MultiTurns
from .stream import Stream

PROTOCOLS: tuple[Protocol, ...] = (Agnostic(), Aware(), Stream(), MultiRequests(), MultiTurns(), MultiAwareRequests())


def names() -> list[str]:
    """What `--protocol` takes, in registration order."""
    return list(dict.fromkeys(p.name for p in PROTOCOLS))


def forms() -> list[str]:
    """What `--form` takes (for a protocol that has forms)."""
    return [p.form for p in PROTOCOLS if p.form is not None]


def check_protocol(name: str, form: str) -> None:
    if name not in names():
        raise KvevictError(f"unknown protocol '{name}': use one of {', '.join(names())}")
    if form not in forms():
        raise KvevictError(f"unknown multi form '{form}': use {', '.join(forms())}")


def get_protocol(name: str, form: str = "requests") -> Protocol:
    """The protocol `--protocol NAME --form FORM` names (the form is read only by a protocol that has forms)."""
    check_protocol(name, form)
    return next(p for p in PROTOCOLS if p.name == name and p.form in (None, form))
