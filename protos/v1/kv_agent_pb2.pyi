from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AgentChannel(_message.Message):
    __slots__ = ("address", "key", "secret")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    address: str
    key: str
    secret: bytes
    def __init__(self, address: _Optional[str] = ..., key: _Optional[str] = ..., secret: _Optional[bytes] = ...) -> None: ...

class AgentTensor(_message.Message):
    __slots__ = ("shape", "dtype")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class AgentRows(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class AgentAccept(_message.Message):
    __slots__ = ("channel",)
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    channel: AgentChannel
    def __init__(self, channel: _Optional[_Union[AgentChannel, _Mapping]] = ...) -> None: ...

class AgentRecv(_message.Message):
    __slots__ = ("channel", "tag", "tensor")
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    channel: AgentChannel
    tag: int
    tensor: AgentTensor
    def __init__(self, channel: _Optional[_Union[AgentChannel, _Mapping]] = ..., tag: _Optional[int] = ..., tensor: _Optional[_Union[AgentTensor, _Mapping]] = ...) -> None: ...

class AgentConnect(_message.Message):
    __slots__ = ("channel",)
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    channel: AgentChannel
    def __init__(self, channel: _Optional[_Union[AgentChannel, _Mapping]] = ...) -> None: ...

class AgentSend(_message.Message):
    __slots__ = ("channel", "tag", "tensor", "fill")
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    FILL_FIELD_NUMBER: _ClassVar[int]
    channel: AgentChannel
    tag: int
    tensor: AgentTensor
    fill: bool
    def __init__(self, channel: _Optional[_Union[AgentChannel, _Mapping]] = ..., tag: _Optional[int] = ..., tensor: _Optional[_Union[AgentTensor, _Mapping]] = ..., fill: _Optional[bool] = ...) -> None: ...

class AgentDrop(_message.Message):
    __slots__ = ("channel",)
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    channel: AgentChannel
    def __init__(self, channel: _Optional[_Union[AgentChannel, _Mapping]] = ...) -> None: ...

class AgentFilled(_message.Message):
    __slots__ = ("error",)
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: str
    def __init__(self, error: _Optional[str] = ...) -> None: ...

class AgentCancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AgentCommand(_message.Message):
    __slots__ = ("call_id", "accept", "recv", "connect", "send", "drop", "filled", "cancel")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_FIELD_NUMBER: _ClassVar[int]
    RECV_FIELD_NUMBER: _ClassVar[int]
    CONNECT_FIELD_NUMBER: _ClassVar[int]
    SEND_FIELD_NUMBER: _ClassVar[int]
    DROP_FIELD_NUMBER: _ClassVar[int]
    FILLED_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    accept: AgentAccept
    recv: AgentRecv
    connect: AgentConnect
    send: AgentSend
    drop: AgentDrop
    filled: AgentFilled
    cancel: AgentCancel
    def __init__(self, call_id: _Optional[int] = ..., accept: _Optional[_Union[AgentAccept, _Mapping]] = ..., recv: _Optional[_Union[AgentRecv, _Mapping]] = ..., connect: _Optional[_Union[AgentConnect, _Mapping]] = ..., send: _Optional[_Union[AgentSend, _Mapping]] = ..., drop: _Optional[_Union[AgentDrop, _Mapping]] = ..., filled: _Optional[_Union[AgentFilled, _Mapping]] = ..., cancel: _Optional[_Union[AgentCancel, _Mapping]] = ...) -> None: ...

class AgentReady(_message.Message):
    __slots__ = ("store_address",)
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    store_address: str
    def __init__(self, store_address: _Optional[str] = ...) -> None: ...

class AgentFailed(_message.Message):
    __slots__ = ("reason", "message")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    message: str
    def __init__(self, reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class AgentMoved(_message.Message):
    __slots__ = ("seconds", "checksum")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    checksum: int
    def __init__(self, seconds: _Optional[float] = ..., checksum: _Optional[int] = ...) -> None: ...

class AgentEvent(_message.Message):
    __slots__ = ("call_id", "ready", "landed", "fill", "moved", "failed")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    LANDED_FIELD_NUMBER: _ClassVar[int]
    FILL_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    ready: AgentReady
    landed: AgentRows
    fill: AgentRows
    moved: AgentMoved
    failed: AgentFailed
    def __init__(self, call_id: _Optional[int] = ..., ready: _Optional[_Union[AgentReady, _Mapping]] = ..., landed: _Optional[_Union[AgentRows, _Mapping]] = ..., fill: _Optional[_Union[AgentRows, _Mapping]] = ..., moved: _Optional[_Union[AgentMoved, _Mapping]] = ..., failed: _Optional[_Union[AgentFailed, _Mapping]] = ...) -> None: ...
