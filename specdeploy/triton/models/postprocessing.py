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
            if tokens.ndim == 2:
                tokens = tokens[:, None, :]
            lengths = lengths.reshape(tokens.shape[0], -1)
            texts = []
            for b in range(tokens.shape[0]):
                beams = []
                for w in range(tokens.shape[1]):
                    n = int(lengths[b, w])
                    text = self.tokenizer.decode(tokens[b, w, :n].tolist(), skip_special_tokens=self.skip_special_tokens)
                    beams.append(text.encode("utf-8"))
                texts.append(beams)
            # [batch * beam], flat as NVIDIA's postprocessing sends it (its clients read text_output[0] as bytes)
            out = np.array([text for beams in texts for text in beams], dtype=object)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", out)]))
        return responses

    def finalize(self):
        pass
