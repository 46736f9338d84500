from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("version", "tensors", "total_bytes", "adapter_config", "data_ticket")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_FIELD_NUMBER: _ClassVar[int]
    DATA_TICKET_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    total_bytes: int
    adapter_config: str
    data_ticket: bytes
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., adapter_config: _Optional[str] = ..., data_ticket: _Optional[bytes] = ...) -> None: ...

class Trailer(_message.Message):
    __slots__ = ("xxh3", "checksum")
    XXH3_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    xxh3: _containers.RepeatedScalarFieldContainer[int]
    checksum: str
    def __init__(self, xxh3: _Optional[_Iterable[int]] = ..., checksum: _Optional[str] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("manifest", "data", "trailer", "offset")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    data: bytes
    trailer: Trailer
    offset: int
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., data: _Optional[bytes] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ..., offset: _Optional[int] = ...) -> None: ...

class StageReply(_message.Message):
    __slots__ = ("version", "bytes_received", "seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    bytes_received: int
    seconds: float
    def __init__(self, version: _Optional[int] = ..., bytes_received: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("version", "pause_seconds", "load_seconds", "adapter_checksum")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    version: int
    pause_seconds: float
    load_seconds: float
    adapter_checksum: str
    def __init__(self, version: _Optional[int] = ..., pause_seconds: _Optional[float] = ..., load_seconds: _Optional[float] = ..., adapter_checksum: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: bool
    def __init__(self, dropped: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("current_version", "staged_version", "engine_url", "served", "adapter_checksum", "stage_port")
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGED_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_URL_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    STAGE_PORT_FIELD_NUMBER: _ClassVar[int]
    current_version: int
    staged_version: int
    engine_url: str
    served: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    adapter_checksum: str
    stage_port: int
    def __init__(self, current_version: _Optional[int] = ..., staged_version: _Optional[int] = ..., engine_url: _Optional[str] = ..., served: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., adapter_checksum: _Optional[str] = ..., stage_port: _Optional[int] = ...) -> None: ...

class ProveRequest(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    def __init__(self, nonce: _Optional[bytes] = ...) -> None: ...

class ProveReply(_message.Message):
    __slots__ = ("server_id", "proof")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    proof: bytes
    def __init__(self, server_id: _Optional[str] = ..., proof: _Optional[bytes] = ...) -> None: ...
