"""Validated, settable policy parameters.

A :class:`Param` is a descriptor: ``policy.x = v`` checks ``v`` on its own, then the
owner's cross-parameter check (as ``configure(x=v)``), and keeps the old value if
either fails - a policy is never left half-configured. ``configure(**kw)`` sets several
at once and checks them together (to move two bounds past each other).
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Iterator
from typing import Any


class Param:
    """A validated attribute of a :class:`Configurable`: ``check(name, value)`` returns
    the value to store or raises."""

    def __init__(self, check: Callable[[str, Any], Any], doc: str = ""):
        self.check = check
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.slot = "_p_" + name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return obj.__dict__[self.slot]

    def __set__(self, obj: Configurable, value: Any) -> None:
        value = self.check(self.name, value)
        if obj.params_ready:  # one change on its own: checked with the others, as configure
            obj.configure(**{self.name: value})
        else:  # in __init__ or inside configure, which checks them all at the end
            obj.__dict__[self.slot] = value


class Configurable:
    """Mixin: ``configure(**kw)`` for :class:`Param` attributes, checked together.

    Subclasses set every Param in ``__init__`` and then call ``_finish_params``; they
    may override ``_check_params`` (cross-parameter rules) and ``_params_changed``
    (e.g. clamp state into new bounds)."""

    _params_ready = False

    @property
    def params_ready(self) -> bool:
        """True once ``__init__`` has set every parameter, outside :meth:`configure`:
        from then on an assignment is checked against the other parameters at once."""
        return self._params_ready

    def _check_params(self) -> None:  # cross-parameter rules
        pass

    def _params_changed(self) -> None:  # e.g. clamp state into new bounds
        pass

    def _finish_params(self) -> None:
        self._check_params()
        self._params_ready = True
        self._params_changed()

    @classmethod
    def param_names(cls) -> tuple[str, ...]:
        names = []
        for klass in reversed(cls.__mro__):
            names += [k for k, v in vars(klass).items() if isinstance(v, Param)]
        return tuple(dict.fromkeys(names))

    def params(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in self.param_names()}

    def configure(self, **kw: Any) -> None:
        """Set several parameters; if any value or the result as a whole is refused,
        every parameter keeps its old value."""
        unknown = sorted(set(kw) - set(self.param_names()))
        if unknown:
            raise TypeError(f"unknown parameter(s) {unknown}; valid: {list(self.param_names())}")
        saved = dict(self.__dict__)
        self._params_ready = False
        try:
            for k, v in kw.items():
                setattr(self, k, v)
            self._check_params()
        except Exception:
            self.__dict__.clear()
            self.__dict__.update(saved)
            raise
        finally:
            self._params_ready = True
        self._params_changed()


@contextlib.contextmanager
def all_or_nothing(*objects: object) -> Iterator[None]:
    """Undo every attribute the block set on ``objects`` if it raises (a policy's
    ``load_state_dict`` is never left half done). A shallow copy of each ``__dict__``:
    the block replaces containers rather than changing them in place."""
    saved = [(o, dict(o.__dict__)) for o in objects]
    try:
        yield
    except BaseException:
        for o, d in saved:
            o.__dict__.clear()
            o.__dict__.update(d)
        raise


@contextlib.contextmanager
def loading(policy_name: str) -> Iterator[None]:
    """Inside ``load_state_dict``: a value refused - by a Param's check, an enum,
    ``float()``, a missing key - becomes one ``ValueError`` line naming the policy."""
    try:
        yield
    except KeyError as e:
        raise ValueError(f"{policy_name} state_dict: missing {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{policy_name} state_dict: {first}") from None


def optional_float(value: Any) -> float | None:
    """A learned value that may not exist yet (None)."""
    return None if value is None else float(value)


# ------------------------------------------------------------------ checks
def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN")
    return value


def positive(name: str, value) -> float:
    value = _number(name, value)
    if not 0.0 < value < math.inf:
        raise ValueError(f"{name} must be > 0 and finite, got {value!r}")
    return value


def non_negative(name: str, value) -> float:
    value = _number(name, value)
    if not 0.0 <= value < math.inf:
        raise ValueError(f"{name} must be >= 0 and finite, got {value!r}")
    return value


def fraction_open_closed(name: str, value) -> float:
    """In (0, 1]."""
    value = _number(name, value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return value


def fraction_closed_open(name: str, value) -> float:
    """In [0, 1)."""
    value = _number(name, value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return value


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def non_negative_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)
