"""What every config section shares: ``ConfigError``, the ``_Section`` base and small helpers.

``_Section`` forbids unknown keys, validates on assignment, refuses infinities, NaN and
booleans where a number is wanted, and reads each field's attribute docstring as its description
(``streamrl config show`` prints it as a comment).
"""

from __future__ import annotations

import difflib
import types
from typing import Any, Iterable, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from streamrl.errors import UserError


class ConfigError(UserError, ValueError):
    """A config file or override is wrong; the message names the key and the value."""

    label = "config error"


def _union_arms(annotation: Any) -> tuple[Any, ...]:
    return get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)


def _misplaced_bool(annotation: Any, value: Any) -> bool:
    """True where ``value`` is (or holds, in a list or dict) a bool where ``annotation`` wants a
    number: YAML's ``true`` is not the integer 1 here."""
    arms = _union_arms(annotation)
    if isinstance(value, bool):
        return bool not in arms and any(a in (int, float) for a in arms)
    for arm in arms:
        origin, args = get_origin(arm), get_args(arm)
        if origin in (list, tuple) and args and isinstance(value, (list, tuple)):
            return any(_misplaced_bool(args[0], v) for v in value)
        if origin is dict and len(args) == 2 and isinstance(value, dict):
            return any(_misplaced_bool(args[1], v) for v in value.values())
    return False


def _choice(value: str, names: Iterable[str], what: str) -> str:
    """``value`` if it is one of ``names``, else an error listing them (and the closest)."""
    names = list(names)
    if value in names:
        return value
    msg = f"unknown {what} {value!r}; choose one of {names}"
    close = difflib.get_close_matches(value, names, n=1)
    if close:
        msg += f"; did you mean {close[0]!r}?"
    raise PydanticCustomError("streamrl_value", msg)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The config section an annotation holds (``NodeGroupConfig`` for ``list[NodeGroupConfig]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        model = _model_in(arg)
        if model is not None:
            return model
    return None


class _Section(BaseModel):
    # allow_inf_nan=False: ``trainer.lr=1e400`` or ``nan`` is a mistake, not a learning rate.
    # use_attribute_docstrings: the docstring under a field is its description.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        """Pydantic's lax mode reads ``true`` as 1; a number field takes numbers (and numeric
        strings: YAML reads ``3e-4`` as a string), never booleans."""
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and _misplaced_bool(field.annotation, value):
            raise PydanticCustomError("streamrl_bool_number", "a boolean is not a number")
        return value
