"""The OpenAI Batch contract (docs/CONTRACT.md): request bodies, the line envelope, error codes, the Batch
object, the result lines, and the C fast path that accepts valid lines. Imports base/ and config/ only.

The request bodies live in one module per endpoint family (chat.py, completions.py, embeddings.py,
scoring.py, responses.py; what they share in common.py), the envelope and the Batch object in
batch.py. Their names are re-exported here, so a caller imports the package and reads
`contract.ChatBody`, `contract.CHAT_URL`, `contract.INVALID_REQUEST`, `contract.Batch`.
Input bodies are validated strictly where OpenAI is strict (ranges, types, roles) and leniently
where it is lenient.
"""

from batch_pipeline.contract.chat import (  # noqa: F401  re-exported
    FUNCTION_NAME,
    CalledFunction,
    ChatBody,
    ChatMessage,
    ChatTool,
    FunctionDef,
    ImagePart,
    ImageUrl,
    JsonSchemaSpec,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    TextPart,
    ToolCall,
    ToolChoice,
    tool_choice_problem,
)
from batch_pipeline.contract.common import (  # noqa: F401  re-exported
    BATCH_CANCELLED,
    BATCH_EXPIRED,
    CHAT_URL,
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    COMPLETIONS_URL,
    CONTEXT_LENGTH_EXCEEDED,
    DUPLICATE_CUSTOM_ID,
    EMBEDDINGS_URL,
    IGNORED_FIELDS,
    INVALID_JSON,
    INVALID_METHOD,
    INVALID_REQUEST,
    MAX_CUSTOM_ID_LENGTH,
    MODEL_NOT_FOUND,
    REFUSED_FIELDS,
    RERANK_URL,
    RESPONSES_URL,
    SCORE_URL,
    SCORING_URLS,
    SUPPORTED_URLS,
    UNSUPPORTED_URL,
    URL_MISMATCH,
    VLLM_SAMPLING_EXTRAS,
    LenientModel,
    ReasoningEffort,
    SamplingBody,
    StopField,
    StrictModel,
    check_fields,
)
from batch_pipeline.contract.completions import (  # noqa: F401  re-exported
    CompletionBody,
)
from batch_pipeline.contract.embeddings import (  # noqa: F401  re-exported
    EmbeddingBody,
)
from batch_pipeline.contract.responses import (  # noqa: F401  re-exported
    HOSTED_TOOL_CHOICE,
    ResponsesBody,
    ResponsesFunctionCall,
    ResponsesFunctionCallOutput,
    ResponsesImagePart,
    ResponsesInputItem,
    ResponsesMessage,
    ResponsesReasoning,
    ResponsesText,
    ResponsesTextFormat,
    ResponsesTextPart,
    ResponsesTool,
)
from batch_pipeline.contract.scoring import (  # noqa: F401  re-exported
    SCORE_SIDES,
    RerankBody,
    ScoreBody,
    ScoreText,
    ScoreTexts,
)

from batch_pipeline.contract.batch import (  # noqa: F401  re-exported
    BatchStatus,
    BODY_MODELS,
    Body,
    BatchRequest,
    RequestCounts,
    InputTokensDetails,
    OutputTokensDetails,
    Usage,
    BatchFileError,
    BatchErrors,
    Batch,
)
