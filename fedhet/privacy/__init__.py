"""Privacy checks of what methods upload: gradient-inversion attacks and PSNR (FedMD-CG's Table 2)."""

from fedhet.privacy.gradient_inversion import (
    UPLOADED_PARTS,
    InversionResult,
    fedcg_generator_gradients,
    initial_dummy,
    invert_gradients,
    psnr,
    reference_psnrs,
    total_variation,
    uploaded_gradients,
)

__all__ = [
    "UPLOADED_PARTS",
    "InversionResult",
    "fedcg_generator_gradients",
    "initial_dummy",
    "invert_gradients",
    "psnr",
    "reference_psnrs",
    "total_variation",
    "uploaded_gradients",
]
