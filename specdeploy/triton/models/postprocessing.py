"""postprocessing: token ids -> text (TOKENS_BATCH [batch, beam, len], SEQUENCE_LENGTH -> OUTPUT).

Same tensors as NVIDIA's inflight_batcher_llm postprocessing model.
"""

import os
import sys

# The python stub runs in isolated mode (PYTHONPATH ignored): the launcher passes our site-packages.
sys.path[:0] = [p for p in os.environ.get("SPECDEPLOY_SITE", "").split(os.pathsep) if p]

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from specdeploy.triton.models import common  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        params = common.parameters(args)
        self.tokenizer = common.load_tokenizer(common.resolve_dir(params["tokenizer_dir"], args))
        self.skip_special_tokens = common.flag(params.get("skip_special_tokens"), True)

    def execute(self, requests):
        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()  # [batch, beam, len]
            lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()  # [batch, beam]
            try:
                texts = self._decode(tokens, lengths)
            except (
                ValueError
            ) as exc:  # ids or lengths a client sent directly: refused with what is wrong, not a traceback
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"postprocessing: {exc}")))
                continue
            # [batch * beam], flat as NVIDIA's postprocessing sends it (its clients read text_output[0] as bytes)
            out = np.array([text for beams in texts for text in beams], dtype=object)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", out)]))
        return responses

    def _decode(self, tokens, lengths) -> list[list[bytes]]:
        if tokens.ndim == 2:
            tokens = tokens[:, None, :]
        if lengths.size != tokens.shape[0] * tokens.shape[1]:
            raise ValueError(
                f"SEQUENCE_LENGTH has {lengths.size} values, TOKENS_BATCH has {tokens.shape[0] * tokens.shape[1]} beams"
            )
        lengths = lengths.reshape(tokens.shape[0], -1)
        texts = []
        for b in range(tokens.shape[0]):
            beams = []
            for w in range(tokens.shape[1]):
                n = int(lengths[b, w])
                if not 0 <= n <= tokens.shape[2]:
                    raise ValueError(
                        f"SEQUENCE_LENGTH {n} is outside [0, {tokens.shape[2]}] (the tokens TOKENS_BATCH holds per"
                        " beam)"
                    )
                ids = tokens[b, w, :n]
                # ids past the tokenizer's vocabulary decode to nothing (a model's embedding may be padded past it);
                # a negative one fails inside the tokenizer (OverflowError)
                if ids.size and int(ids.min()) < 0:
                    raise ValueError(f"TOKENS_BATCH holds token id {int(ids.min())}; token ids are >= 0")
                beams.append(
                    self.tokenizer.decode(ids.tolist(), skip_special_tokens=self.skip_special_tokens).encode("utf-8")
                )
            texts.append(beams)
        return texts

    def finalize(self):
        pass
