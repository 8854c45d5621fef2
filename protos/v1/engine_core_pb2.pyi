from splitserve.protos.v1 import generation_pb2 as _generation_pb2
from splitserve.protos.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CoreQueryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CORE_QUERY_KIND_UNSPECIFIED: _ClassVar[CoreQueryKind]
    CORE_QUERY_KIND_KV_SNAPSHOT: _ClassVar[CoreQueryKind]
    CORE_QUERY_KIND_DRAIN_KV_EVENTS: _ClassVar[CoreQueryKind]
    CORE_QUERY_KIND_METRICS: _ClassVar[CoreQueryKind]

class CorePrefillEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CORE_PREFILL_EVENT_KIND_UNSPECIFIED: _ClassVar[CorePrefillEventKind]
    CORE_PREFILL_EVENT_KIND_SEND_STARTED: _ClassVar[CorePrefillEventKind]
    CORE_PREFILL_EVENT_KIND_FIRST_TOKEN: _ClassVar[CorePrefillEventKind]
    CORE_PREFILL_EVENT_KIND_TRANSFER_DONE: _ClassVar[CorePrefillEventKind]
CORE_QUERY_KIND_UNSPECIFIED: CoreQueryKind
CORE_QUERY_KIND_KV_SNAPSHOT: CoreQueryKind
CORE_QUERY_KIND_DRAIN_KV_EVENTS: CoreQueryKind
CORE_QUERY_KIND_METRICS: CoreQueryKind
CORE_PREFILL_EVENT_KIND_UNSPECIFIED: CorePrefillEventKind
CORE_PREFILL_EVENT_KIND_SEND_STARTED: CorePrefillEventKind
CORE_PREFILL_EVENT_KIND_FIRST_TOKEN: CorePrefillEventKind
CORE_PREFILL_EVENT_KIND_TRANSFER_DONE: CorePrefillEventKind

class CoreAddRequest(_message.Message):
    __slots__ = ("request_id", "generate", "prefill", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    generate: _worker_pb2.WorkerGenerateRequest
    prefill: _worker_pb2.PrefillRequest
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., generate: _Optional[_Union[_worker_pb2.WorkerGenerateRequest, _Mapping]] = ..., prefill: _Optional[_Union[_worker_pb2.PrefillRequest, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CoreQuery(_message.Message):
    __slots__ = ("call_id", "kind")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    kind: CoreQueryKind
    def __init__(self, call_id: _Optional[int] = ..., kind: _Optional[_Union[CoreQueryKind, str]] = ...) -> None: ...

class CoreCommand(_message.Message):
    __slots__ = ("add", "abort_request_id", "query", "shutdown", "processed")
    ADD_FIELD_NUMBER: _ClassVar[int]
    ABORT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    PROCESSED_FIELD_NUMBER: _ClassVar[int]
    add: CoreAddRequest
    abort_request_id: str
    query: CoreQuery
    shutdown: bool
    processed: CoreProcessed
    def __init__(self, add: _Optional[_Union[CoreAddRequest, _Mapping]] = ..., abort_request_id: _Optional[str] = ..., query: _Optional[_Union[CoreQuery, _Mapping]] = ..., shutdown: _Optional[bool] = ..., processed: _Optional[_Union[CoreProcessed, _Mapping]] = ...) -> None: ...

class CoreStepTotals(_message.Message):
    __slots__ = ("kind", "num_steps", "seconds", "num_seqs", "num_tokens", "context_tokens", "attention_tokens2", "bucket_counts")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_TOKENS2_FIELD_NUMBER: _ClassVar[int]
    BUCKET_COUNTS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    num_steps: int
    seconds: float
    num_seqs: int
    num_tokens: int
    context_tokens: int
    attention_tokens2: int
    bucket_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[str] = ..., num_steps: _Optional[int] = ..., seconds: _Optional[float] = ..., num_seqs: _Optional[int] = ..., num_tokens: _Optional[int] = ..., context_tokens: _Optional[int] = ..., attention_tokens2: _Optional[int] = ..., bucket_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class CoreLoad(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "block_size", "num_awaiting_kv", "num_held_blocks", "num_held_requests", "kv_usage", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "num_lease_expiries", "num_failed_requests", "tensor_parallel_size", "steps")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_AWAITING_KV_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASE_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    num_awaiting_kv: int
    num_held_blocks: int
    num_held_requests: int
    kv_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_lease_expiries: int
    num_failed_requests: int
    tensor_parallel_size: int
    steps: _containers.RepeatedCompositeFieldContainer[CoreStepTotals]
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_awaiting_kv: _Optional[int] = ..., num_held_blocks: _Optional[int] = ..., num_held_requests: _Optional[int] = ..., kv_usage: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_lease_expiries: _Optional[int] = ..., num_failed_requests: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[CoreStepTotals, _Mapping]]] = ...) -> None: ...

class CoreReady(_message.Message):
    __slots__ = ("block_size", "max_model_len", "vocab_size", "tensor_parallel_size", "num_kv_heads", "load", "num_threads")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    max_model_len: int
    vocab_size: int
    tensor_parallel_size: int
    num_kv_heads: int
    load: CoreLoad
    num_threads: int
    def __init__(self, block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., load: _Optional[_Union[CoreLoad, _Mapping]] = ..., num_threads: _Optional[int] = ...) -> None: ...

class CoreReply(_message.Message):
    __slots__ = ("call_id", "block_hashes", "events", "metrics")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    events: _containers.RepeatedCompositeFieldContainer[_worker_pb2.KVCacheEvent]
    metrics: bytes
    def __init__(self, call_id: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., events: _Optional[_Iterable[_Union[_worker_pb2.KVCacheEvent, _Mapping]]] = ..., metrics: _Optional[bytes] = ...) -> None: ...

class CoreEvent(_message.Message):
    __slots__ = ("ready", "step_tokens", "load", "reply", "refused", "died", "prefill_event")
    READY_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    DIED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_EVENT_FIELD_NUMBER: _ClassVar[int]
    ready: CoreReady
    step_tokens: CoreStepTokens
    load: CoreLoad
    reply: CoreReply
    refused: CoreRefusal
    died: str
    prefill_event: CorePrefillEvent
    def __init__(self, ready: _Optional[_Union[CoreReady, _Mapping]] = ..., step_tokens: _Optional[_Union[CoreStepTokens, _Mapping]] = ..., load: _Optional[_Union[CoreLoad, _Mapping]] = ..., reply: _Optional[_Union[CoreReply, _Mapping]] = ..., refused: _Optional[_Union[CoreRefusal, _Mapping]] = ..., died: _Optional[str] = ..., prefill_event: _Optional[_Union[CorePrefillEvent, _Mapping]] = ...) -> None: ...

class CorePrefillEvent(_message.Message):
    __slots__ = ("request_id", "response", "kind", "queue_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: bytes
    kind: CorePrefillEventKind
    queue_ms: float
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[bytes] = ..., kind: _Optional[_Union[CorePrefillEventKind, str]] = ..., queue_ms: _Optional[float] = ...) -> None: ...

class CoreStepTokens(_message.Message):
    __slots__ = ("ticket", "time", "request_ids", "token_ids", "num_cached_tokens", "first_scheduled_times", "finished", "logprobs", "failed", "load", "handoff_times")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_SCHEDULED_TIMES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_TIMES_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    time: float
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    first_scheduled_times: _containers.RepeatedScalarFieldContainer[float]
    finished: _containers.RepeatedCompositeFieldContainer[CoreFinish]
    logprobs: _containers.RepeatedCompositeFieldContainer[CoreRequestLogprobs]
    failed: _containers.RepeatedCompositeFieldContainer[CoreFailure]
    load: CoreLoad
    handoff_times: _containers.RepeatedCompositeFieldContainer[CoreHandoffTimes]
    def __init__(self, ticket: _Optional[int] = ..., time: _Optional[float] = ..., request_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[_Iterable[int]] = ..., first_scheduled_times: _Optional[_Iterable[float]] = ..., finished: _Optional[_Iterable[_Union[CoreFinish, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[CoreRequestLogprobs, _Mapping]]] = ..., failed: _Optional[_Iterable[_Union[CoreFailure, _Mapping]]] = ..., load: _Optional[_Union[CoreLoad, _Mapping]] = ..., handoff_times: _Optional[_Iterable[_Union[CoreHandoffTimes, _Mapping]]] = ...) -> None: ...

class CoreHandoffTimes(_message.Message):
    __slots__ = ("request_id", "prefill_queue_ms", "prefill_compute_ms", "first_token_time", "landed_time")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TIME_FIELD_NUMBER: _ClassVar[int]
    LANDED_TIME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill_queue_ms: float
    prefill_compute_ms: float
    first_token_time: float
    landed_time: float
    def __init__(self, request_id: _Optional[str] = ..., prefill_queue_ms: _Optional[float] = ..., prefill_compute_ms: _Optional[float] = ..., first_token_time: _Optional[float] = ..., landed_time: _Optional[float] = ...) -> None: ...

class CoreFinish(_message.Message):
    __slots__ = ("request_id", "reason", "stop_token_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    stop_token_id: int
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class CoreRequestLogprobs(_message.Message):
    __slots__ = ("request_id", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    logprobs: _generation_pb2.TokenLogprob
    def __init__(self, request_id: _Optional[str] = ..., logprobs: _Optional[_Union[_generation_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class CoreFailure(_message.Message):
    __slots__ = ("request_id", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    message: str
    def __init__(self, request_id: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class CoreProcessed(_message.Message):
    __slots__ = ("ticket", "stopped_request_ids", "failed_request_ids")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    STOPPED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    stopped_request_ids: _containers.RepeatedScalarFieldContainer[str]
    failed_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ticket: _Optional[int] = ..., stopped_request_ids: _Optional[_Iterable[str]] = ..., failed_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class CoreRefusal(_message.Message):
    __slots__ = ("request_id", "error", "code", "failed_peer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    FAILED_PEER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    error: str
    code: str
    failed_peer: str
    def __init__(self, request_id: _Optional[str] = ..., error: _Optional[str] = ..., code: _Optional[str] = ..., failed_peer: _Optional[str] = ...) -> None: ...
