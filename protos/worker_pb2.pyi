from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_NONE: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_MAX_TOKENS: _ClassVar[FinishReason]
FINISH_REASON_NONE: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_MAX_TOKENS: FinishReason

class LoraAdapterRef(_message.Message):
    __slots__ = ("name", "path", "unload")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    UNLOAD_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    unload: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., unload: _Optional[bool] = ...) -> None: ...

class LoadLoraAdapterReply(_message.Message):
    __slots__ = ("rank",)
    RANK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    def __init__(self, rank: _Optional[int] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("kind", "spec", "disable_any_whitespace")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    disable_any_whitespace: bool
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ..., disable_any_whitespace: _Optional[bool] = ...) -> None: ...

class PrepareConstraintReply(_message.Message):
    __slots__ = ("compile_seconds", "cached")
    COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    compile_seconds: float
    cached: bool
    def __init__(self, compile_seconds: _Optional[float] = ..., cached: _Optional[bool] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_theta", "max_position_embeddings", "tie_word_embeddings", "eos_token_ids", "bos_token_id", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    ROPE_THETA_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    TIE_WORD_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    path: str
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., intermediate_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., rope_theta: _Optional[float] = ..., max_position_embeddings: _Optional[int] = ..., tie_word_embeddings: _Optional[bool] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model", "dtype", "device", "block_size", "num_blocks", "max_model_len", "epoch", "attention_backend", "kv_bytes_per_block", "last_step_id", "fencing_token", "tensor_parallel_size", "rank_num_blocks", "rank_kv_bytes_per_block", "num_state_slots", "state_bytes_per_slot")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RANK_KV_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_PER_SLOT_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    dtype: str
    device: str
    block_size: int
    num_blocks: int
    max_model_len: int
    epoch: str
    attention_backend: str
    kv_bytes_per_block: int
    last_step_id: int
    fencing_token: int
    tensor_parallel_size: int
    rank_num_blocks: _containers.RepeatedScalarFieldContainer[int]
    rank_kv_bytes_per_block: int
    num_state_slots: int
    state_bytes_per_slot: int
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., max_model_len: _Optional[int] = ..., epoch: _Optional[str] = ..., attention_backend: _Optional[str] = ..., kv_bytes_per_block: _Optional[int] = ..., last_step_id: _Optional[int] = ..., fencing_token: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., rank_num_blocks: _Optional[_Iterable[int]] = ..., rank_kv_bytes_per_block: _Optional[int] = ..., num_state_slots: _Optional[int] = ..., state_bytes_per_slot: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "ignore_eos", "min_tokens", "max_tokens", "stop_token_ids", "logprobs", "constraint", "logit_bias", "bad_words", "prompt_logprobs", "embed")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EMBED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    ignore_eos: bool
    min_tokens: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: int
    constraint: Constraint
    logit_bias: _containers.ScalarMap[int, float]
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenIds]
    prompt_logprobs: int
    embed: bool
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., bad_words: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., prompt_logprobs: _Optional[int] = ..., embed: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("slot", "request_id", "prompt_token_ids", "sampling", "block_ids", "num_computed_tokens", "num_scheduled_tokens", "lora_name", "lora_path", "state_slot")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    slot: int
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    lora_name: str
    lora_path: str
    state_slot: int
    def __init__(self, slot: _Optional[int] = ..., request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., state_slot: _Optional[int] = ...) -> None: ...

class ResumedRequest(_message.Message):
    __slots__ = ("slot", "request_id", "token_ids", "num_prompt_tokens", "sampling", "block_ids", "num_computed_tokens", "num_scheduled_tokens", "lora_name", "lora_path", "state_slot")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    slot: int
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    lora_name: str
    lora_path: str
    state_slot: int
    def __init__(self, slot: _Optional[int] = ..., request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., state_slot: _Optional[int] = ...) -> None: ...

class CachedRequests(_message.Message):
    __slots__ = ("slots", "num_scheduled_tokens", "num_new_blocks", "new_block_ids", "num_draft_slots")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slots: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., num_new_blocks: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_draft_slots: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockTable(_message.Message):
    __slots__ = ("slot", "block_ids")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slot: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "fencing_token", "expected_epoch", "reset_batch", "dropped_slots", "new_requests", "resumed_requests", "cached", "replaced_tables", "copy_blocks", "after_step_id", "prompt_lookup_min", "prompt_lookup_max", "state_copy_src", "state_copy_dst", "state_save_src", "state_save_dst")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESET_BATCH_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    REPLACED_TABLES_FIELD_NUMBER: _ClassVar[int]
    COPY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    AFTER_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_MIN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_MAX_FIELD_NUMBER: _ClassVar[int]
    STATE_COPY_SRC_FIELD_NUMBER: _ClassVar[int]
    STATE_COPY_DST_FIELD_NUMBER: _ClassVar[int]
    STATE_SAVE_SRC_FIELD_NUMBER: _ClassVar[int]
    STATE_SAVE_DST_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    fencing_token: int
    expected_epoch: str
    reset_batch: bool
    dropped_slots: _containers.RepeatedScalarFieldContainer[int]
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    resumed_requests: _containers.RepeatedCompositeFieldContainer[ResumedRequest]
    cached: CachedRequests
    replaced_tables: _containers.RepeatedCompositeFieldContainer[BlockTable]
    copy_blocks: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    after_step_id: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    state_copy_src: _containers.RepeatedScalarFieldContainer[int]
    state_copy_dst: _containers.RepeatedScalarFieldContainer[int]
    state_save_src: _containers.RepeatedScalarFieldContainer[int]
    state_save_dst: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., fencing_token: _Optional[int] = ..., expected_epoch: _Optional[str] = ..., reset_batch: _Optional[bool] = ..., dropped_slots: _Optional[_Iterable[int]] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., resumed_requests: _Optional[_Iterable[_Union[ResumedRequest, _Mapping]]] = ..., cached: _Optional[_Union[CachedRequests, _Mapping]] = ..., replaced_tables: _Optional[_Iterable[_Union[BlockTable, _Mapping]]] = ..., copy_blocks: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., after_step_id: _Optional[int] = ..., prompt_lookup_min: _Optional[int] = ..., prompt_lookup_max: _Optional[int] = ..., state_copy_src: _Optional[_Iterable[int]] = ..., state_copy_dst: _Optional[_Iterable[int]] = ..., state_save_src: _Optional[_Iterable[int]] = ..., state_save_dst: _Optional[_Iterable[int]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "slots", "token_ids", "finish_reasons", "logprob_indices", "logprobs", "num_top_logprobs", "top_logprob_token_ids", "top_logprobs", "prepare_seconds", "forward_seconds", "sample_seconds", "num_scheduled_tokens", "previous_step_id", "idle_seconds", "num_constrained", "mask_seconds", "spec_slots", "spec_num_draft_tokens", "spec_num_accepted_tokens", "prompt_lp_slots", "prompt_lp_starts", "prompt_lp_counts", "prompt_lp_values", "prompt_lp_top_token_ids", "prompt_lp_top_values", "pooled_slots", "pooled", "embedding_dim", "prompt_lp_num_top")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_INDICES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROB_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CONSTRAINED_FIELD_NUMBER: _ClassVar[int]
    MASK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LP_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LP_STARTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LP_COUNTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LP_VALUES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LP_TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LP_TOP_VALUES_FIELD_NUMBER: _ClassVar[int]
    POOLED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIM_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LP_NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    slots: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reasons: _containers.RepeatedScalarFieldContainer[FinishReason]
    logprob_indices: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    num_top_logprobs: _containers.RepeatedScalarFieldContainer[int]
    top_logprob_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prepare_seconds: float
    forward_seconds: float
    sample_seconds: float
    num_scheduled_tokens: int
    previous_step_id: int
    idle_seconds: float
    num_constrained: int
    mask_seconds: float
    spec_slots: _containers.RepeatedScalarFieldContainer[int]
    spec_num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    spec_num_accepted_tokens: _containers.RepeatedScalarFieldContainer[int]
    prompt_lp_slots: _containers.RepeatedScalarFieldContainer[int]
    prompt_lp_starts: _containers.RepeatedScalarFieldContainer[int]
    prompt_lp_counts: _containers.RepeatedScalarFieldContainer[int]
    prompt_lp_values: _containers.RepeatedScalarFieldContainer[float]
    prompt_lp_top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_lp_top_values: _containers.RepeatedScalarFieldContainer[float]
    pooled_slots: _containers.RepeatedScalarFieldContainer[int]
    pooled: _containers.RepeatedScalarFieldContainer[float]
    embedding_dim: int
    prompt_lp_num_top: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., slots: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reasons: _Optional[_Iterable[_Union[FinishReason, str]]] = ..., logprob_indices: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., num_top_logprobs: _Optional[_Iterable[int]] = ..., top_logprob_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., prepare_seconds: _Optional[float] = ..., forward_seconds: _Optional[float] = ..., sample_seconds: _Optional[float] = ..., num_scheduled_tokens: _Optional[int] = ..., previous_step_id: _Optional[int] = ..., idle_seconds: _Optional[float] = ..., num_constrained: _Optional[int] = ..., mask_seconds: _Optional[float] = ..., spec_slots: _Optional[_Iterable[int]] = ..., spec_num_draft_tokens: _Optional[_Iterable[int]] = ..., spec_num_accepted_tokens: _Optional[_Iterable[int]] = ..., prompt_lp_slots: _Optional[_Iterable[int]] = ..., prompt_lp_starts: _Optional[_Iterable[int]] = ..., prompt_lp_counts: _Optional[_Iterable[int]] = ..., prompt_lp_values: _Optional[_Iterable[float]] = ..., prompt_lp_top_token_ids: _Optional[_Iterable[int]] = ..., prompt_lp_top_values: _Optional[_Iterable[float]] = ..., pooled_slots: _Optional[_Iterable[int]] = ..., pooled: _Optional[_Iterable[float]] = ..., embedding_dim: _Optional[int] = ..., prompt_lp_num_top: _Optional[_Iterable[int]] = ...) -> None: ...
