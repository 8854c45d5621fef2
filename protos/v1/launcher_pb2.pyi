from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ScaleRequest(_message.Message):
    __slots__ = ("num_unified", "num_prefill", "num_decode")
    NUM_UNIFIED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_FIELD_NUMBER: _ClassVar[int]
    num_unified: int
    num_prefill: int
    num_decode: int
    def __init__(self, num_unified: _Optional[int] = ..., num_prefill: _Optional[int] = ..., num_decode: _Optional[int] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("started", "drained", "shape")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    started: _containers.RepeatedScalarFieldContainer[str]
    drained: _containers.RepeatedScalarFieldContainer[str]
    shape: str
    def __init__(self, started: _Optional[_Iterable[str]] = ..., drained: _Optional[_Iterable[str]] = ..., shape: _Optional[str] = ...) -> None: ...
