from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LayoutInfo(_message.Message):
    __slots__ = ("name", "data", "model", "attention", "weight_bytes_per_device", "kv_cache_bytes_per_device", "all_reduces_per_layer", "pool", "device_ids", "description", "unusable")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_PER_DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_PER_DEVICE_FIELD_NUMBER: _ClassVar[int]
    ALL_REDUCES_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    UNUSABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    data: int
    model: int
    attention: str
    weight_bytes_per_device: int
    kv_cache_bytes_per_device: int
    all_reduces_per_layer: int
    pool: str
    device_ids: _containers.RepeatedScalarFieldContainer[int]
    description: str
    unusable: str
    def __init__(self, name: _Optional[str] = ..., data: _Optional[int] = ..., model: _Optional[int] = ..., attention: _Optional[str] = ..., weight_bytes_per_device: _Optional[int] = ..., kv_cache_bytes_per_device: _Optional[int] = ..., all_reduces_per_layer: _Optional[int] = ..., pool: _Optional[str] = ..., device_ids: _Optional[_Iterable[int]] = ..., description: _Optional[str] = ..., unusable: _Optional[str] = ...) -> None: ...

class ListLayoutsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("name", "layout", "device_ids", "is_default")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    name: str
    layout: LayoutInfo
    device_ids: _containers.RepeatedScalarFieldContainer[int]
    is_default: bool
    def __init__(self, name: _Optional[str] = ..., layout: _Optional[_Union[LayoutInfo, _Mapping]] = ..., device_ids: _Optional[_Iterable[int]] = ..., is_default: _Optional[bool] = ...) -> None: ...

class ListLayoutsResponse(_message.Message):
    __slots__ = ("presets", "pools")
    PRESETS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    presets: _containers.RepeatedCompositeFieldContainer[LayoutInfo]
    pools: _containers.RepeatedCompositeFieldContainer[PoolInfo]
    def __init__(self, presets: _Optional[_Iterable[_Union[LayoutInfo, _Mapping]]] = ..., pools: _Optional[_Iterable[_Union[PoolInfo, _Mapping]]] = ...) -> None: ...

class GetLayoutRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class SetLayoutRequest(_message.Message):
    __slots__ = ("pool", "layout")
    POOL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    pool: str
    layout: str
    def __init__(self, pool: _Optional[str] = ..., layout: _Optional[str] = ...) -> None: ...
