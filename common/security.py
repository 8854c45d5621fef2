"""Who may call which gRPC service, and over what transport (torch-free: the gateway uses it).

Three kinds of method:
  open      health checks and reflection (unless a server is told to guard them too);
  internal  Registry (on the gateway), Worker (on every worker), Launcher: only members of the
            cluster, that is callers holding the join secret (metadata JOIN_SECRET_HEADER) and,
            with cluster TLS, a certificate from the cluster CA (checked by the TLS handshake)
            that names the cluster (CLUSTER_TLS_NAME; checked per call on members-only servers:
            the same CA signs public clients' certificates, which must not make a member);
  public    Generation: callers with an API key (gateway/auth.py), when keys are configured.

Cluster TLS: every process presents one certificate signed by the cluster CA, and every channel
that carries the join secret first verifies the server's certificate against that CA: a process that
took over a port a member is known by (a dead worker's, or one named before it was bound) never
completes the handshake, so it never sees the secret. Members present their certificate too, and
internal servers (workers, the gateway's internal port, the launcher) require one (mTLS). Channels
check the name CLUSTER_TLS_NAME, not the address, because workers come and go on addresses nobody
can put in a certificate beforehand; a channel with the CA but no certificate (an operator's) checks
the server's host name. Health checks never carry the secret: they are open, and a squatter could
answer them. Without a CA (processes started by hand without certificates) internal calls carry the
secret in plaintext to whatever listens at the address: only the join secret protects them.

Secrets come from files or the environment, never from command-line values (which any local user
can read in the process listing).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

JOIN_SECRET_ENV = "SPLITSERVE_JOIN_SECRET"
JOIN_SECRET_HEADER = "splitserve-join-secret"
CLUSTER_TLS_NAME = "splitserve-cluster"
OPEN_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
)

Metadata = tuple[tuple[str, str], ...]
Denial = tuple[grpc.StatusCode, str]  # the status and message a refused call ends with


def read_secret(path: str | None, env_var: str) -> str | None:
    """A secret from a file (first line, stripped) or else the environment; None when neither."""
    if path:
        text = Path(path).read_text().strip()
        if not text:
            raise ValueError(f"{path} is empty; put the secret on its first line")
        return text.splitlines()[0].strip()
    return os.environ.get(env_var) or None


@dataclass(frozen=True, slots=True)
class TlsIdentity:
    """A certificate chain and its private key (PEM)."""

    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def load(cls, cert: str, key: str) -> TlsIdentity:
        return cls(Path(cert).read_bytes(), Path(key).read_bytes())


@dataclass(frozen=True, slots=True)
class ClusterSecurity:
    """How this process meets the rest of the cluster. All None: plaintext and open (local use)."""

    join_secret: str | None = None
    ca_pem: bytes | None = None  # verifies the gateway (and, with identity, every worker and caller)
    identity: TlsIdentity | None = None  # this process's cluster certificate: mTLS between workers

    def __post_init__(self) -> None:
        if self.identity is not None and self.ca_pem is None:
            raise ValueError("--cluster-cert needs --cluster-ca (the CA that signed every cluster certificate)")

    @classmethod
    def from_files(
        cls, ca: str | None = None, cert: str | None = None, key: str | None = None, secret_file: str | None = None
    ) -> ClusterSecurity:
        if (cert is None) != (key is None):
            raise ValueError("give --cluster-cert and --cluster-key together")
        identity = TlsIdentity.load(cert, key) if cert and key else None
        ca_pem = Path(ca).read_bytes() if ca else None
        return cls(read_secret(secret_file, JOIN_SECRET_ENV), ca_pem, identity)

    @property
    def call_metadata(self) -> Metadata:
        return ((JOIN_SECRET_HEADER, self.join_secret),) if self.join_secret else ()

    def admits(self, metadata: Metadata) -> bool:
        """Whether a call carries the join secret (always, when there is none)."""
        if self.join_secret is None:
            return True
        given = dict(metadata).get(JOIN_SECRET_HEADER, "")
        return hmac.compare_digest(given.encode(), self.join_secret.encode())

    def admits_peer(self, auth_context: Mapping[str, Iterable[bytes]]) -> bool:
        """Whether a caller's verified certificate names the cluster (always, without cluster TLS).
        The cluster CA also signs a bundle's public client certificate: verified, but not a member's."""
        if self.identity is None:
            return True
        return CLUSTER_TLS_NAME.encode() in list(auth_context.get("x509_subject_alternative_name", ()))

    def server_credentials(self, require_client_auth: bool = True) -> grpc.ServerCredentials | None:
        """TLS with this process's cluster certificate (workers: callers need one too), or None (plaintext)."""
        if self.identity is None:
            return None
        pair = [(self.identity.key_pem, self.identity.cert_pem)]
        roots = self.ca_pem if require_client_auth else None
        return grpc.ssl_server_credentials(pair, root_certificates=roots, require_client_auth=require_client_auth)

    def _credentials(self) -> grpc.ChannelCredentials:
        key, chain = (self.identity.key_pem, self.identity.cert_pem) if self.identity else (None, None)
        return grpc.ssl_channel_credentials(self.ca_pem, private_key=key, certificate_chain=chain)

    def _name_check(self) -> list[tuple[str, object]]:
        """A member verifies peers by the cluster's name; an operator with only the CA, by host name."""
        return [("grpc.ssl_target_name_override", CLUSTER_TLS_NAME)] if self.identity is not None else []

    def worker_channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        """A channel to a worker (from the gateway or another worker)."""
        interceptors = _metadata_interceptors(self.call_metadata)
        if self.identity is None:
            return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
        options = [*options, *self._name_check()]
        return grpc.aio.secure_channel(address, self._credentials(), options=options, interceptors=interceptors)

    def gateway_channel(self, address: str) -> grpc.aio.Channel:
        """A channel to the gateway's Registry (TLS when there is a CA to verify the gateway with)."""
        interceptors = _metadata_interceptors(self.call_metadata)
        if self.ca_pem is None:
            return grpc.aio.insecure_channel(address, interceptors=interceptors)
        options = self._name_check()
        return grpc.aio.secure_channel(address, self._credentials(), options=options, interceptors=interceptors)

    def blocking_channel(self, address: str, to_worker: bool = True) -> grpc.Channel:
        """A synchronous channel to a worker (or the gateway, or the launcher), for the launcher and the CLI."""
        if self.ca_pem is not None and (self.identity is not None or not to_worker):
            channel = grpc.secure_channel(address, self._credentials(), options=self._name_check())
        else:
            channel = grpc.insecure_channel(address)
        if not self.call_metadata:
            return channel
        return grpc.intercept_channel(channel, _BlockingMetadata(self.call_metadata))


OPEN_CLUSTER = ClusterSecurity()  # plaintext, no join secret: a laptop, or tests of everything else


@dataclass(frozen=True, slots=True)
class GatewayCredentials:
    """How a public client reaches the gateway: TLS when tls_ca is given (with identity: a client
    certificate, for a gateway that requires one), and the API key on every call."""

    tls_ca: str | None = None
    api_key: str | None = None
    identity: TlsIdentity | None = None

    def channel(self, address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
        interceptors = _metadata_interceptors(_bearer(self.api_key))
        if self.tls_ca is None:
            return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
        credentials = _client_credentials(self.tls_ca, self.identity)
        return grpc.aio.secure_channel(address, credentials, options=list(options), interceptors=interceptors)

    def blocking_channel(self, address: str) -> grpc.Channel:
        if self.tls_ca is None:
            channel = grpc.insecure_channel(address)
        else:
            channel = grpc.secure_channel(address, _client_credentials(self.tls_ca, self.identity))
        return grpc.intercept_channel(channel, _BlockingMetadata(_bearer(self.api_key))) if self.api_key else channel


PLAINTEXT_GATEWAY = GatewayCredentials()


def _bearer(api_key: str | None) -> Metadata:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _client_credentials(tls_ca: str, identity: TlsIdentity | None) -> grpc.ChannelCredentials:
    key, chain = (identity.key_pem, identity.cert_pem) if identity else (None, None)
    return grpc.ssl_channel_credentials(Path(tls_ca).read_bytes(), private_key=key, certificate_chain=chain)


def _replace(details: grpc.aio.ClientCallDetails, metadata: Metadata) -> grpc.aio.ClientCallDetails:
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, grpc.aio.Metadata(*metadata), details.credentials, details.wait_for_ready
    )


class _AioUnaryMetadata(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds fixed metadata (the join secret, an API key) to every unary call on a channel."""

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_replace(client_call_details, _merged(client_call_details, self.metadata)), request)


class _AioStreamMetadata(grpc.aio.UnaryStreamClientInterceptor):
    """The same for response streams (grpc.aio files an interceptor under its first kind only)."""

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_replace(client_call_details, _merged(client_call_details, self.metadata)), request)


def _merged(details, metadata: Metadata) -> Metadata:
    """The call's metadata plus ours, less the join secret on open services: a health check goes to
    whoever listens at an address, before anything proves who that is (without TLS, nothing ever does).
    An API key stays: a gateway may guard its health checks with keys (--guard-health)."""
    method = details.method.decode() if isinstance(details.method, bytes) else details.method
    if method.split("/")[1] in OPEN_SERVICES:
        metadata = tuple((k, v) for k, v in metadata if k != JOIN_SECRET_HEADER)
    return (*tuple(details.metadata or ()), *metadata)


def _metadata_interceptors(metadata: Metadata) -> list[grpc.aio.ClientInterceptor] | None:
    return [_AioUnaryMetadata(metadata), _AioStreamMetadata(metadata)] if metadata else None


class _BlockingCallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: Metadata) -> None:
        self.method, self.timeout, self.credentials = details.method, details.timeout, details.credentials
        self.wait_for_ready, self.compression = details.wait_for_ready, details.compression
        self.metadata = _merged(details, metadata)


class _BlockingMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(_BlockingCallDetails(client_call_details, self.metadata), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(_BlockingCallDetails(client_call_details, self.metadata), request)


# --- the server side --------------------------------------------------------------------------------

# Decides a public call from its metadata.
PublicCheck = Callable[[Metadata], Awaitable["Admission"]]


@dataclass(frozen=True, slots=True)
class Admission:
    """A public call's verdict: admitted (with a release to call when it ends), or denied."""

    denial: Denial | None = None
    trailing: Metadata = ()
    release: Callable[[], None] | None = None


class AccessGuard(grpc.aio.ServerInterceptor):
    """Checks every call by its service before the servicer sees it (see the module docstring).

    members_only: the server requires a cluster certificate from every caller (a worker, the gateway's
    internal port), so an internal call must also come from a certificate that names the cluster. A
    port shared with public clients (a gateway without an internal port) cannot ask that of workers
    that registered there without showing a certificate."""

    def __init__(
        self,
        cluster: ClusterSecurity,
        internal_services: Sequence[str],
        public_check: PublicCheck | None = None,
        guard_open_services: bool = False,
        members_only: bool = False,
    ) -> None:
        self.cluster, self.public_check = cluster, public_check
        self.internal = frozenset(internal_services)
        self.guard_open = guard_open_services
        self.members_only = members_only
        self.on_denied: Callable[[str, grpc.StatusCode], None] | None = None  # (kind, code): for a metric

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        service = handler_call_details.method.split("/")[1]
        metadata = tuple(handler_call_details.invocation_metadata or ())
        if service in self.internal:
            if not self.cluster.admits(metadata):
                return self._deny(handler, "internal", grpc.StatusCode.UNAUTHENTICATED, _NOT_A_MEMBER)
            return _peer_checked(handler, self._check_peer) if self.members_only else handler
        if self.public_check is None or (service in OPEN_SERVICES and not self.guard_open):
            return handler
        return _admitted(handler, lambda: self._admit(metadata))

    async def _admit(self, metadata: Metadata) -> Admission:
        assert self.public_check is not None  # only public calls are admitted
        admission = await self.public_check(metadata)
        if admission.denial is not None and self.on_denied is not None:
            self.on_denied("public", admission.denial[0])
        return admission

    async def _check_peer(self, context: grpc.aio.ServicerContext) -> None:
        if not self.cluster.admits_peer(context.auth_context()):
            if self.on_denied is not None:
                self.on_denied("internal", grpc.StatusCode.PERMISSION_DENIED)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, _NOT_A_MEMBER_CERTIFICATE)

    def _deny(self, handler, kind: str, code: grpc.StatusCode, message: str, trailing: Metadata = ()):
        if self.on_denied is not None:
            self.on_denied(kind, code)
        return _denying_handler(handler, code, message, trailing)


_NOT_A_MEMBER = (
    "this service is for members of the splitserve cluster: call with the cluster's join secret "
    f"(metadata {JOIN_SECRET_HEADER}; give the process --join-secret-file or {JOIN_SECRET_ENV})"
)


_NOT_A_MEMBER_CERTIFICATE = (
    f"this service is for members of the splitserve cluster: your certificate does not name {CLUSTER_TLS_NAME} "
    "(a public client's certificate, though the cluster CA signed it); call with the cluster certificate"
)


def _peer_checked(handler, check: Callable[[grpc.aio.ServicerContext], Awaitable[None]]):
    """The same handler, checking the caller's certificate first: only a handler sees the call's TLS
    peer (an interceptor gets the method and metadata alone). Internal services are unary or
    server-streaming."""
    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_stream is not None:
        behavior = handler.unary_stream

        async def stream(request, context):
            await check(context)
            async for response in behavior(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def call(request, context):
            await check(context)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(call, **kwargs)
    raise TypeError(f"internal services are unary or server-streaming; got {handler!r}")


def _denying_handler(handler, code: grpc.StatusCode, message: str, trailing: Metadata):
    async def deny_unary(request, context):
        await context.abort(code, message, trailing_metadata=trailing)

    async def deny_stream(request, context):
        await context.abort(code, message, trailing_metadata=trailing)
        yield  # an async generator, as a streaming handler must be

    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
    if handler.stream_stream is not None:  # reflection
        return grpc.stream_stream_rpc_method_handler(deny_stream, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny_unary, **kwargs)


def _admitted(handler, admit: Callable[[], Awaitable[Admission]]):
    """The same handler, admitting the call once its request has been parsed (grpc runs a handler only
    then), and releasing what admission took when the call ends however it ends. Admitting in the
    interceptor instead would take a slot for calls whose request never parses or never comes: no
    handler runs for them, so nothing would release it."""
    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_stream is not None:
        behavior = handler.unary_stream

        async def stream(request, context):
            admission = await admit()
            if admission.denial is not None:
                await context.abort(*admission.denial, trailing_metadata=admission.trailing)
            try:
                async for response in behavior(request, context):
                    yield response
            finally:
                if admission.release is not None:
                    admission.release()

        return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def call(request, context):
            admission = await admit()
            if admission.denial is not None:
                await context.abort(*admission.denial, trailing_metadata=admission.trailing)
            try:
                return await unary(request, context)
            finally:
                if admission.release is not None:
                    admission.release()

        return grpc.unary_unary_rpc_method_handler(call, **kwargs)
    if handler.stream_stream is not None:  # reflection under --guard-health: the key is checked, not limited
        streams = handler.stream_stream

        async def each(requests, context):
            admission = await admit()
            if admission.release is not None:
                admission.release()
            if admission.denial is not None:
                await context.abort(*admission.denial, trailing_metadata=admission.trailing)
            async for response in streams(requests, context):
                yield response

        return grpc.stream_stream_rpc_method_handler(each, **kwargs)
    return handler


class BlockingAccessGuard(grpc.ServerInterceptor):
    """AccessGuard for a synchronous, members-only server whose services are internal and unary (the
    Launcher): the join secret, and a certificate that names the cluster."""

    def __init__(self, cluster: ClusterSecurity, internal_services: Sequence[str]) -> None:
        self.cluster, self.internal = cluster, frozenset(internal_services)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        service = handler_call_details.method.split("/")[1]
        if handler is None or service not in self.internal:
            return handler
        kwargs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if not self.cluster.admits(tuple(handler_call_details.invocation_metadata or ())):

            def deny(request, context):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, _NOT_A_MEMBER)

            return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
        unary = handler.unary_unary

        def call(request, context):
            if not self.cluster.admits_peer(context.auth_context()):
                context.abort(grpc.StatusCode.PERMISSION_DENIED, _NOT_A_MEMBER_CERTIFICATE)
            return unary(request, context)

        return grpc.unary_unary_rpc_method_handler(call, **kwargs)
