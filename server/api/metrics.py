"""Route GET /metrics: specserve's and vLLM's metrics in Prometheus text format."""

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics() -> Response:
    # One registry holds both: vLLM's stat logger registers `vllm:*` in the default one.
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
