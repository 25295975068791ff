from setuptools import find_packages, setup

setup(
    name="vistrain",
    version="0.1.0",
    description="Self-supervised vision pretraining (SimCLR, SwAV on RegNet) with a built-in "
    "fully sharded data parallel engine",
    packages=find_packages(include=["vistrain", "vistrain.*"]),
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
    extras_require={"dev": ["pytest>=7", "pytest-timeout>=2"]},
)
