"""The `llm` app's ingress: Ray Serve LLM's own (`OpenAiIngress`), with OpenAI's error body for
an unknown model. Ray 2.60 raises FastAPI's HTTPException there, which FastAPI answers with
`{"detail": ...}` before Ray's error middleware sees it, so the `openai` client gets a bare
"Error code: 404". Here it becomes Ray's OpenAIHTTPException, which that middleware renders
as `{"error": {"message", "type", "code"}}`. tests/workloads/test_serve_hf.py fails when Ray
moves the method this overrides.

Imported only by Serve, by name (`ingress_cls_config`), after workloads.serve.llm has checked
that vLLM imports: this module needs it.
"""

from fastapi import HTTPException
from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException
from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress

class OpenAIErrorsIngress(OpenAiIngress):
    async def _get_model_id(self, model):
        try:
            return await super()._get_model_id(model)
        except HTTPException as e:
            kind = "NotFoundError" if e.status_code == 404 else "BadRequestError"
            raise OpenAIHTTPException(e.status_code, str(e.detail), type=kind) from None
