from splitserve.protos.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_UNIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]

class KVBackend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_BACKEND_UNSPECIFIED: _ClassVar[KVBackend]
    KV_BACKEND_GLOO: _ClassVar[KVBackend]
    KV_BACKEND_NCCL: _ClassVar[KVBackend]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_UNIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
KV_BACKEND_UNSPECIFIED: KVBackend
KV_BACKEND_GLOO: KVBackend
KV_BACKEND_NCCL: KVBackend

class EngineSamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "skip_special_tokens", "include_stop_str_in_output")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ...) -> None: ...

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "priority", "prefill_address", "params", "continuation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    prefill_address: str
    params: EngineSamplingParams
    continuation: Continuation
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., prefill_address: _Optional[str] = ..., params: _Optional[_Union[EngineSamplingParams, _Mapping]] = ..., continuation: _Optional[_Union[Continuation, _Mapping]] = ...) -> None: ...

class Continuation(_message.Message):
    __slots__ = ("output_token_ids", "num_text_chars")
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_text_chars: int
    def __init__(self, output_token_ids: _Optional[_Iterable[int]] = ..., num_text_chars: _Optional[int] = ...) -> None: ...

class KVChannel(_message.Message):
    __slots__ = ("store_address", "key", "secret", "backend")
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    store_address: str
    key: str
    secret: bytes
    backend: KVBackend
    def __init__(self, store_address: _Optional[str] = ..., key: _Optional[str] = ..., secret: _Optional[bytes] = ..., backend: _Optional[_Union[KVBackend, str]] = ...) -> None: ...

class KVPiece(_message.Message):
    __slots__ = ("src_rank", "dst_rank", "first_kv_head", "num_kv_heads", "channel", "transfer_tag")
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    FIRST_KV_HEAD_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TAG_FIELD_NUMBER: _ClassVar[int]
    src_rank: int
    dst_rank: int
    first_kv_head: int
    num_kv_heads: int
    channel: KVChannel
    transfer_tag: int
    def __init__(self, src_rank: _Optional[int] = ..., dst_rank: _Optional[int] = ..., first_kv_head: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., channel: _Optional[_Union[KVChannel, _Mapping]] = ..., transfer_tag: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request", "channel", "transfer_tag", "num_skip_blocks", "kv_layout", "decode_tensor_parallel_size", "pieces")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TAG_FIELD_NUMBER: _ClassVar[int]
    NUM_SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DECODE_TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    request: WorkerGenerateRequest
    channel: KVChannel
    transfer_tag: int
    num_skip_blocks: int
    kv_layout: str
    decode_tensor_parallel_size: int
    pieces: _containers.RepeatedCompositeFieldContainer[KVPiece]
    def __init__(self, request: _Optional[_Union[WorkerGenerateRequest, _Mapping]] = ..., channel: _Optional[_Union[KVChannel, _Mapping]] = ..., transfer_tag: _Optional[int] = ..., num_skip_blocks: _Optional[int] = ..., kv_layout: _Optional[str] = ..., decode_tensor_parallel_size: _Optional[int] = ..., pieces: _Optional[_Iterable[_Union[KVPiece, _Mapping]]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "transfer_done", "send_started")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_DONE_FIELD_NUMBER: _ClassVar[int]
    SEND_STARTED_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    transfer_done: TransferDone
    send_started: SendStarted
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., transfer_done: _Optional[_Union[TransferDone, _Mapping]] = ..., send_started: _Optional[_Union[SendStarted, _Mapping]] = ...) -> None: ...

class SendStarted(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprobs", "num_blocks", "queue_ms", "compute_ms")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    num_blocks: int
    queue_ms: float
    compute_ms: float
    def __init__(self, token_id: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., num_blocks: _Optional[int] = ..., queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ...) -> None: ...

class TransferDone(_message.Message):
    __slots__ = ("num_blocks", "num_bytes", "send_ms", "piece_checksums_xxh3")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEND_MS_FIELD_NUMBER: _ClassVar[int]
    PIECE_CHECKSUMS_XXH3_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_bytes: int
    send_ms: float
    piece_checksums_xxh3: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., send_ms: _Optional[float] = ..., piece_checksums_xxh3: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerGenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs", "finish_reason", "stop_reason", "usage", "queue_ms", "stages")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    finish_reason: _generation_pb2.FinishReason
    stop_reason: str
    usage: _generation_pb2.Usage
    queue_ms: float
    stages: _generation_pb2.StageTimings
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., usage: _Optional[_Union[_generation_pb2.Usage, _Mapping]] = ..., queue_ms: _Optional[float] = ..., stages: _Optional[_Union[_generation_pb2.StageTimings, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "block_size", "num_awaiting_kv", "role", "num_held_blocks", "num_held_requests", "tensor_parallel_size")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_AWAITING_KV_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    num_awaiting_kv: int
    role: WorkerRole
    num_held_blocks: int
    num_held_requests: int
    tensor_parallel_size: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_awaiting_kv: _Optional[int] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., num_held_blocks: _Optional[int] = ..., num_held_requests: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("address", "role", "model", "max_model_len", "metrics_address", "block_size", "vocab_size")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: WorkerRole
    model: str
    max_model_len: int
    metrics_address: str
    block_size: int
    vocab_size: int
    def __init__(self, address: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., metrics_address: _Optional[str] = ..., block_size: _Optional[int] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class DeregisterWorkerResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class BlockStoredEvent(_message.Message):
    __slots__ = ("block_hashes", "parent_hash", "token_ids", "block_size")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ...) -> None: ...

class BlockRemovedEvent(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AllBlocksClearedEvent(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVCacheEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStoredEvent
    removed: BlockRemovedEvent
    cleared: AllBlocksClearedEvent
    def __init__(self, stored: _Optional[_Union[BlockStoredEvent, _Mapping]] = ..., removed: _Optional[_Union[BlockRemovedEvent, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksClearedEvent, _Mapping]] = ...) -> None: ...

class PublishKVEventsRequest(_message.Message):
    __slots__ = ("address", "instance_id", "seq", "events", "is_snapshot", "snapshot_block_hashes", "model", "block_size")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    IS_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    address: str
    instance_id: str
    seq: int
    events: _containers.RepeatedCompositeFieldContainer[KVCacheEvent]
    is_snapshot: bool
    snapshot_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    model: str
    block_size: int
    def __init__(self, address: _Optional[str] = ..., instance_id: _Optional[str] = ..., seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KVCacheEvent, _Mapping]]] = ..., is_snapshot: _Optional[bool] = ..., snapshot_block_hashes: _Optional[_Iterable[bytes]] = ..., model: _Optional[str] = ..., block_size: _Optional[int] = ...) -> None: ...

class PublishKVEventsResponse(_message.Message):
    __slots__ = ("resync", "register")
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    resync: bool
    register: bool
    def __init__(self, resync: _Optional[bool] = ..., register: _Optional[bool] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("draining",)
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    def __init__(self, draining: _Optional[bool] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "role", "model", "healthy", "outstanding", "load", "metrics_address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    role: WorkerRole
    model: str
    healthy: bool
    outstanding: int
    load: LoadReport
    metrics_address: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., model: _Optional[str] = ..., healthy: _Optional[bool] = ..., outstanding: _Optional[int] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ..., metrics_address: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...
