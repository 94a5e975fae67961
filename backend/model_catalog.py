"""The models the service answers for: allowed ids, their manifests and tokenizers (cached), the
public model list and tokenization."""

from __future__ import annotations

from backend import registry
from backend.normalize import RequestError, check_model_id, check_text
from backend.schemas import CertificatePublic, ModelPublic, TokenizeResponse, TokenPiece
from backend.service_error import ServiceError
from backend.settings import Settings
from backend.tokens import TokenCodec, codec_for_file


class ModelCatalog:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._models: dict[str, tuple[int, registry.ModelInfo, TokenCodec]] = {}

    def resolve_model(self, model_id: str) -> tuple[registry.ModelInfo, TokenCodec]:
        """The manifest and codec of an allowed model, cached until its manifest file changes.

        Why cached: every POST needs both; reading the manifest and stat-ing the tokenizer on each
        request is most of a cache hit's cost. One stat of the manifest (written last when a model is
        fetched) tells whether a refetch happened.
        """
        check_model_id(model_id, self.allowed_models())
        try:
            manifest = registry.model_dir(model_id) / registry.MANIFEST_NAME
            try:
                stamp = manifest.stat().st_mtime_ns
            except FileNotFoundError:
                raise registry.ModelNotAvailable(model_id) from None
            cached = self._models.get(model_id)
            if cached is not None and cached[0] == stamp:
                return cached[1], cached[2]
            info = registry.model_info(model_id)
            codec = codec_for_file(registry.tokenizer_path(model_id))
            self._models[model_id] = (stamp, info, codec)
            return info, codec
        except registry.UnknownModel as error:
            raise RequestError(str(error), field="model") from None
        except registry.ModelNotAvailable as error:
            raise ServiceError(503, str(error)) from None

    def allowed_models(self) -> list[str]:
        """The ids this service answers for: the operator's list, else every id in the registry."""
        known = registry.list_models()
        allowed = self.settings.allowed_models
        return known if allowed is None else [model_id for model_id in allowed if model_id in known]

    def models(self) -> list[ModelPublic]:
        answers = []
        for model_id in self.allowed_models():
            if not registry.is_available(model_id):
                answers.append(ModelPublic(id=model_id, available=False))
                continue
            info = registry.model_info(model_id)
            certificate = registry.read_certificate(info.digest, info.dtype)
            answers.append(
                ModelPublic(
                    id=model_id,
                    available=True,
                    n_params=info.n_params,
                    size_bytes=info.size_bytes,
                    vocab_size=info.vocab_size,
                    n_layers=info.n_layers,
                    d_model=info.d_model,
                    digest=info.digest,
                    architecture=info.architecture,
                    dtype=info.dtype,
                    description=info.description,
                    registered=info.registered,
                    certificate=None
                    if certificate is None
                    else CertificatePublic.model_validate(certificate),
                )
            )
        return answers

    def tokenize(self, model_id: str, text: str, special_tokens: bool) -> TokenizeResponse:
        _, codec = self.resolve_model(model_id)
        check_text(text, "text")
        ids = codec.encode_prefix(text) if special_tokens else codec.encode_continuation(text)
        pieces = [TokenPiece(**piece) for piece in codec.pieces(ids)]
        return TokenizeResponse(model=model_id, text=text, special_tokens=special_tokens, tokens=pieces)
