from setuptools import find_packages, setup

LIGHTNING = ["pytorch-lightning>=2.6,<2.7"]  # the Lightning releases tests run against

setup(
    name="vistrain",
    version="0.1.0",
    description="Self-supervised vision pretraining (SimCLR, SwAV on RegNet) with a built-in "
    "fully sharded data parallel engine",
    # the recipes live in configs/ for readers and ship inside the package as vistrain.configs
    packages=[*find_packages(include=["vistrain", "vistrain.*"]), "vistrain.configs"],
    package_dir={"vistrain.configs": "configs"},
    package_data={"vistrain.configs": ["*.yaml", "**/*.yaml"]},
    python_requires=">=3.9",
    install_requires=[
        "torch>=2.4,<3",
        "torchvision>=0.19,<1",
        "fvcore>=0.1.5",
        "pyyaml>=5.4",
        "pillow>=9",
        "tensorboard>=2.10",
        "scikit-learn>=1.0",  # ships the real handwritten digits used by the demo data set
    ],
    extras_require={
        # Trainer(strategy="vistrain_fsdp"): vistrain.integrations.lightning
        "lightning": LIGHTNING,
        # DATA_SOURCES: [elpv]: 2,624 solar-cell images (91 MB, CC BY-NC-SA 4.0), vistrain/data/elpv.py;
        # not in dev: the tests run on a generated folder of its layout and read the package if present
        "elpv": ["elpv-dataset>=1.0"],
        # MODEL.TRUNK.NAME: timm (vistrain/models/trunks/timm_models.py)
        "timm": ["timm>=1.0"],
        # .safetensors files as WEIGHTS_INIT.PARAMS_FILE (the exports write them without it)
        "safetensors": ["safetensors>=0.4"],
        # DATA_SOURCES: [webdataset]: tar shards (vistrain/data/shards.py, tools/make_shards.py)
        "webdataset": ["webdataset>=0.2.86"],
        # DATA_SOURCES: [hf_dataset]: a Hugging Face data set saved on disk
        "datasets": ["datasets>=2.14"],
        # TIFF images of any number of bands
        "tiff": ["tifffile>=2023.1"],
        # pictures with axes and colour maps (monitor, embeddings, attention maps)
        "plots": ["matplotlib>=3.6"],
        # embeddings as a parquet table beside the .npy
        "parquet": ["pyarrow>=12"],
        # Weights & Biases as a second logger (LOGGING.WANDB)
        "wandb": ["wandb>=0.16"],
        "dev": [
            "timm>=1.0",
            "safetensors>=0.4",
            "webdataset>=0.2.86",
            "datasets>=2.14",
            "tifffile>=2023.1",
            "matplotlib>=3.6",
            "pyarrow>=12",
            "wandb>=0.16",
            # the batched-augmentation library dev/bench/bench_pipeline.py compares the views with
            "kornia>=0.7",
            "pytest>=7",
            "pytest-timeout>=2",
            "pytest-xdist>=3",
            "ruff==0.14.14",
            *LIGHTNING,
            # test-only oracle: the MoCo v3 / Barlow Twins / VICReg / LeJEPA losses are checked against
            # lightly's on the same tensors (tests/test_joint_embedding_losses.py); vistrain never imports it
            "lightly==1.6.0",
        ],
    },
)
