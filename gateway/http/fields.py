"""Reading a JSON request body's fields with their types checked, as OpenAI's API does: a field
sent as null counts as left out; a wrong type or range is a 400 naming the field (`param`)."""

from __future__ import annotations

from collections.abc import Mapping

from splitserve.gateway.http.errors import bad_request

UINT32_MAX = 2**32 - 1


class Fields:
    """One JSON object (a request body, a message, stream_options)."""

    def __init__(self, value: object, where: str = "") -> None:
        if not isinstance(value, dict):
            raise bad_request(f"{where or 'the request body'} must be a JSON object", where or None)
        self.values: dict = value
        self.where = where  # the object's own name in error messages ("" for the body)

    def param(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def get(self, name: str) -> object | None:
        return self.values.get(name)

    def is_null(self, name: str) -> bool:
        """Sent, as null (some fields mean something else then than when left out)."""
        return name in self.values and self.values[name] is None

    def boolean(self, name: str, default: bool) -> bool:
        value = self.values.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad_request(f"{self.param(name)} must be true or false, got {_show(value)}", self.param(name))
        return value

    def integer(self, name: str, default: int | None, low: int | None = None, high: int | None = None) -> int | None:
        value = self.values.get(name)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer():  # 16.0: JSON numbers have no int type
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(f"{self.param(name)} must be an integer, got {_show(value)}", self.param(name))
        _check_range(self.param(name), value, low, high)
        return value

    def number(self, name: str, default: float | None) -> float | None:
        """Ranges are the validator's (it knows them for both APIs); only the type is checked here."""
        value = self.values.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_request(f"{self.param(name)} must be a number, got {_show(value)}", self.param(name))
        return float(value)

    def string(self, name: str, default: str | None) -> str | None:
        value = self.values.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise bad_request(f"{self.param(name)} must be a string, got {_show(value)}", self.param(name))
        return value

    def strings(self, name: str) -> tuple[str, ...]:
        """A string or a list of strings (as `stop` is)."""
        value = self.values.get(name)
        if value is None:
            return ()
        if isinstance(value, str):
            return (value,)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise bad_request(f"{self.param(name)} must be a string or a list of strings", self.param(name))

    def token_ids(self, name: str) -> tuple[int, ...]:
        value = self.values.get(name)
        if value is None:
            return ()
        ids = as_token_ids(value)
        if ids is None:
            raise bad_request(f"{self.param(name)} must be a list of token ids (integers >= 0)", self.param(name))
        return ids

    def obj(self, name: str) -> Fields | None:
        value = self.values.get(name)
        return None if value is None else Fields(value, self.param(name))

    def reject_unsupported(self, accepted: Mapping[str, tuple[object, ...]]) -> None:
        """Fields this server cannot honour: each may be left out, null, or one of its accepted values.
        Refused rather than ignored, so that nobody gets output that silently ignored what they asked."""
        for name, values in accepted.items():
            value = self.values.get(name)
            if value is not None and value not in values:
                raise bad_request(
                    f"{self.param(name)}={_show(value)} is not supported by this server (splitserve); leave it out "
                    "(docs/openai.md lists what is supported)",
                    self.param(name),
                )


def as_token_ids(value: object) -> tuple[int, ...] | None:
    """value as token ids when it is a list of ints in uint32 (the proto's type), else None."""
    if not isinstance(value, list):
        return None
    if all(type(v) is int and 0 <= v <= UINT32_MAX for v in value):
        return tuple(value)
    return None


def _check_range(param: str, value: int, low: int | None, high: int | None) -> None:
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        raise bad_request(f"{param} must be in {bounds}, got {value}", param)


def _show(value: object, num_chars: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= num_chars else text[:num_chars] + "..."
