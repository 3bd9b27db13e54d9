"""voxdiff: does gradient accumulation change how a 3D label-to-MRI diffusion model converges?"""

__version__ = "0.1.0"
