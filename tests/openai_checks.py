"""The OpenAI-client checks that every GPU run repeats (the CPU suite's, imported here once): tests/gpu runs them on
its own app, tests/served against a server that is already running. `from tests.openai_checks import *` collects
them in the importing module, where its `summit` and `client` fixtures apply."""

from tests.cpu.test_errors import (
    test_invalid_parameters_are_400,
    test_malformed_body_is_400,
    test_max_tokens_beyond_the_context_is_400,
    test_prompt_longer_than_max_model_len_is_400,
    test_unknown_model_is_404_listing_known,
)
from tests.cpu.test_openai_api import (
    test_32_concurrent_streams_complete,
    test_chat_completion,
    test_chat_stream_with_usage,
    test_completion_logprobs_with_echo,
    test_completion_max_tokens_in_usage,
    test_completion_stream,
    test_min_tokens_holds_back_a_stop_token,
    test_n_choices,
    test_penalties_change_what_is_repeated,
    test_prompt_logprobs_and_top_logprobs,
    test_request_id_returned,
    test_seed_reproducible,
    test_stop_string_ends_the_output,
    test_tokenize_detokenize_round_trip,
    test_top_k_and_min_p_narrow_the_sampling,
)

__all__ = [
    "test_32_concurrent_streams_complete",
    "test_chat_completion",
    "test_chat_stream_with_usage",
    "test_completion_logprobs_with_echo",
    "test_completion_max_tokens_in_usage",
    "test_completion_stream",
    "test_invalid_parameters_are_400",
    "test_malformed_body_is_400",
    "test_max_tokens_beyond_the_context_is_400",
    "test_min_tokens_holds_back_a_stop_token",
    "test_n_choices",
    "test_penalties_change_what_is_repeated",
    "test_prompt_logprobs_and_top_logprobs",
    "test_prompt_longer_than_max_model_len_is_400",
    "test_request_id_returned",
    "test_seed_reproducible",
    "test_stop_string_ends_the_output",
    "test_tokenize_detokenize_round_trip",
    "test_top_k_and_min_p_narrow_the_sampling",
    "test_unknown_model_is_404_listing_known",
]
