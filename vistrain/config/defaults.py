"""Every config key, its default and what it means. YAML recipes in configs/ hold only differences.

Key names follow VISSL where an equivalent exists so that VISSL users feel at home.
Each component receives only its own section (e.g. the optimizer builder gets ``cfg.OPTIMIZER``).
"""

import copy
from typing import Optional

from fvcore.common.config import CfgNode as CN

_C = CN()
# Version of this key layout. Saved config.yaml files carry it; reading one written by another
# version is refused (keys may have changed meaning). Bump it when a key is renamed or re-meant.
_C.VERSION = 1
_C.JOB = "train"  # what a run does: train | linear_eval | knn | finetune | extract_features
_C.SEED_VALUE = 0  # seeds model init, data order and augmentations (offset by rank where needed)
_C.LOG_FREQUENCY = 10  # rank-0 log line every this many iterations

_C.MACHINE = CN()
_C.MACHINE.DEVICE = "auto"  # auto (cuda when available) | cpu | cuda
# CPU ranks: glibc maps every allocation of at least this many MiB on its own and gives it back
# when freed (0: glibc's default, whose heaps keep freed blocks of up to 32 MiB). Lower peak RSS
# for sharded runs of big models, slower steps (vistrain/runtime/host_memory.py has the numbers).
_C.MACHINE.CPU_MMAP_THRESHOLD_MIB = 0.0
# Memory per rank the auto-tuner (MODEL.FSDP_CONFIG.AUTO_TUNE) plans for, in MiB. 0: what the machine
# has: on CPU the memory available at start shared by this node's ranks, on CUDA the device's
# memory, each less a margin (vistrain/planner/auto_tune.py)
_C.MACHINE.MEMORY_BUDGET_MIB = 0.0
# Speed of the link between nodes, Gbit/s each way, for the auto-tuner's choice of
# MODEL.FSDP_CONFIG.shard_group_size in a job that spans nodes. 0: measured once at start (a short
# timed all-reduce between the nodes' first ranks)
_C.MACHINE.INTER_NODE_GBPS = 0.0

# ---------------------------------------------------------------------------------------------
_C.DISTRIBUTED = CN()
_C.DISTRIBUTED.BACKEND = "auto"  # auto (nccl on cuda, gloo on cpu) | nccl | gloo
_C.DISTRIBUTED.NUM_NODES = 1  # machines taking part
_C.DISTRIBUTED.NUM_PROC_PER_NODE = 1  # ranks spawned on this machine (one per GPU on CUDA)
_C.DISTRIBUTED.NODE_ID = 0  # this machine's index in [0, NUM_NODES)
_C.DISTRIBUTED.INIT_METHOD = "tcp"  # tcp | env (join torchrun/SLURM variables) | file
_C.DISTRIBUTED.RUN_ID = "auto"  # tcp: host:port of node 0 ("auto": localhost, free port); file: path
_C.DISTRIBUTED.TIMEOUT_SECONDS = 600  # collective timeout; a dead rank fails the job after this

# ---------------------------------------------------------------------------------------------
_C.DATA = CN()
# DataLoader worker processes per rank; -1: chosen for the machine from its cores, the ranks on it and
# their threads (vistrain/data/loader.py auto_workers: on a CPU box whose ranks use every core, 0)
_C.DATA.NUM_DATALOADER_WORKERS = -1
_C.DATA.PIN_MEMORY = True  # pinned host memory (only used on CUDA)
_C.DATA.CACHE_DIR = ""  # where bundled data sets are written ("" -> ~/.cache/vistrain)
# elpv: seed of the 75/25 train/test split, stratified by (class, cell type); TRAIN and TEST share it
_C.DATA.SPLIT_SEED = 0
# channels of the views of both splits, MODEL.TRUNK.IN_CHANNELS unless a recipe or override sets it
# (then they must match): 3 (RGB; grey images repeated), 1 (grey; RGB images made grey), or the
# images' own count (bands of TIFF or .npy images)
_C.DATA.CHANNELS = 3
# 0: each split normalises with its TRANSFORMS.MEAN / STD; N > 0: both splits with the per-channel
# mean and std of N images of DATA.TRAIN spread over it (scaled as for the views), computed when a
# loader is built and logged
_C.DATA.NORMALIZE_FROM_IMAGES = 0


def _split_defaults(batch_size, shuffle):
    split = CN()
    # one per data set: disk_folder | disk_filelist | synthetic | demo_digits | elpv | webdataset | hf_dataset
    split.DATA_SOURCES = ["synthetic"]
    # folder (disk_folder), text file of "path label" lines (disk_filelist), elpv: "" for the
    # installed elpv-dataset package or a folder holding its labels.csv and images/, webdataset: a
    # brace pattern of tar shards (/data/shards/train-{000000..000099}.tar); hf_dataset: a folder
    # written by save_to_disk, an image folder, a folder of parquet files or a parquet file
    split.DATA_PATHS = [""]
    # which split of demo_digits / elpv (val: its 25% test side) / a disk_folder with train/ and val/
    split.SPLIT = "train"
    # disk_folder: subfolders (<path>/<class>/<image>, labelled) | none (every image below <path>,
    # label -1: pretraining only) | auto (none when <path> holds images itself, else subfolders)
    split.FOLDER_LABELS = "auto"
    split.DECODE_SIZE = 0  # elpv: side images are resized to once, when decoded and kept in memory (0: 300)
    split.DATA_LIMIT = -1  # use only the first N samples (-1: all)
    split.SYNTHETIC_SIZE = 256  # number of images of the synthetic source
    split.SYNTHETIC_NUM_CLASSES = 10  # labels of the synthetic source
    split.IMAGE_SIZE = 32  # side of synthetic images
    split.BATCHSIZE_PER_REPLICA = batch_size  # images per rank per iteration
    split.SHUFFLE = shuffle  # reshuffle every epoch (order depends only on seed and epoch)
    split.DROP_LAST = shuffle  # drop the incomplete last batch
    # webdataset: a rank's part of the epoch is shuffled within windows of this many samples (its
    # shuffle buffer; larger mixes more, reads spread over more of a shard; vistrain/data/shards.py)
    split.SHUFFLE_WINDOW = 1000
    split.SKIP_CORRUPT = False  # True: skip unreadable images (counted in logs); False: stop the run
    # pixel values mapped to [0, 1] (clipped): [low, high], or [] for the dtype's range (8-bit
    # 0..255, 16-bit 0..65535, floats 0..1)
    split.PIXEL_RANGE = []
    split.HF_IMAGE_COLUMN = "image"  # hf_dataset: the column of the images (Image, or arrays)
    split.HF_LABEL_COLUMN = "label"  # hf_dataset: the column of integer labels ("": unlabelled, -1)
    split.HF_SPLIT = ""  # hf_dataset: the split to read ("": the only one there is)
    # True: the loader's workers decode and draw the random numbers, the views are made on the run's
    # device (the GPU) from the decoded images moved there; the same views as False (vistrain/data/device_views.py)
    split.VIEWS_ON_DEVICE = False
    # True: VIEWS_ON_DEVICE, and JPEGs are decoded on the run's device too (nvjpeg on a GPU, a batch
    # at a time): the workers read each file's header and draw the random numbers from its size;
    # the same views as False; other images, and JPEGs the device refuses, decoded as before
    # (vistrain/data/device_decode.py)
    split.DECODE_ON_DEVICE = False
    split.TRANSFORMS = CN()  # see vistrain/data/transforms.py
    split.TRANSFORMS.NAME = (
        "multicrop" if shuffle else "eval"
    )  # multicrop (SSL views) | eval (resize+center crop)
    split.TRANSFORMS.NUM_CROPS = [2]  # crops per resolution, e.g. [2, 6]
    split.TRANSFORMS.SIZE_CROPS = [32]  # crop side per resolution, e.g. [224, 96]
    split.TRANSFORMS.CROP_SCALES = [[0.14, 1.0]]  # RandomResizedCrop scale range per resolution
    split.TRANSFORMS.AFFINE_DEGREES = 0.0  # random rotation within +-degrees (0: off), before the crop
    split.TRANSFORMS.AFFINE_TRANSLATE = 0.0  # random shift up to this fraction of the side (0: off)
    split.TRANSFORMS.AFFINE_SCALE = [1.0, 1.0]  # random zoom range of the affine step ([1, 1]: off)
    split.TRANSFORMS.AFFINE_SHEAR = 0.0  # random shear within +-degrees (0: off)
    split.TRANSFORMS.ELASTIC_PROB = 0.0  # probability of an elastic distortion (digits; 0: off)
    split.TRANSFORMS.ELASTIC_ALPHA = 20.0  # elastic displacement strength (pixels)
    split.TRANSFORMS.ELASTIC_SIGMA = 4.0  # elastic displacement smoothness (Gaussian sigma, pixels)
    split.TRANSFORMS.HORIZONTAL_FLIP = 0.5  # probability
    split.TRANSFORMS.VERTICAL_FLIP = 0.0  # probability (images with no up: solar cells, tiles)
    split.TRANSFORMS.ROTATE_90 = 0.0  # probability of a rotation by 90, 180 or 270 degrees
    split.TRANSFORMS.COLOR_DISTORTION = 0.5  # strength s: jitter 0.8s w.p. 0.8, grayscale w.p. 0.2
    split.TRANSFORMS.BLUR_PROB = 0.5  # Gaussian blur probability
    split.TRANSFORMS.BLUR_RADIUS = [0.1, 2.0]  # blur sigma range
    split.TRANSFORMS.SOLARIZE_PROB = 0.0  # solarisation probability
    split.TRANSFORMS.RESIZE = 36  # eval: shorter side before the center crop
    split.TRANSFORMS.CENTER_CROP = 32  # eval: crop side
    # normalisation per channel: DATA.CHANNELS values each, or one for all channels (DATA.NORMALIZE_FROM_IMAGES
    # computes them from the images)
    split.TRANSFORMS.MEAN = [0.485, 0.456, 0.406]
    split.TRANSFORMS.STD = [0.229, 0.224, 0.225]
    return split


_C.DATA.TRAIN = _split_defaults(batch_size=32, shuffle=True)
_C.DATA.TEST = _split_defaults(batch_size=64, shuffle=False)
_C.DATA.TEST.SPLIT = "val"
# linear_eval, knn, finetune: train on a stratified part of the labelled TRAIN split only, every
# class keeping round(f * its images) of them, at least one (SimCLR's and BYOL's 1% / 10% protocol;
# vistrain/benchmarks/label_fraction.py). The same LABEL_SUBSET_SEED gives the same images, and the
# images of a smaller fraction are among those of a larger one. 1.0: every labelled image
_C.DATA.TRAIN.LABEL_FRACTION = 1.0
_C.DATA.TRAIN.LABEL_SUBSET_SEED = 0

# ---------------------------------------------------------------------------------------------
_C.MODEL = CN()
_C.MODEL.TRUNK = CN()
_C.MODEL.TRUNK.NAME = "regnet"  # registry name of the trunk: regnet | resnet | vit | timm | torchvision
# channels of the images the trunk takes: timm's in_chans; in the other families the first
# convolution takes IN_CHANNELS inputs (torch's default initialisation when it is not 3)
_C.MODEL.TRUNK.IN_CHANNELS = 3
_C.MODEL.TRUNK.REGNET = CN()
_C.MODEL.TRUNK.REGNET.NAME = "regnet_y_400mf"  # published name, or "custom" to use the raw parameters
_C.MODEL.TRUNK.REGNET.DEPTH = 0  # raw design-space parameters (used when NAME is "custom")
_C.MODEL.TRUNK.REGNET.W_0 = 0
_C.MODEL.TRUNK.REGNET.W_A = 0.0
_C.MODEL.TRUNK.REGNET.W_M = 0.0
_C.MODEL.TRUNK.REGNET.GROUP_WIDTH = 0
_C.MODEL.TRUNK.REGNET.SE_RATIO = 0.25  # squeeze-excitation ratio (0: RegNetX)
_C.MODEL.TRUNK.REGNET.BOTTLENECK_MULTIPLIER = 1.0
_C.MODEL.TRUNK.REGNET.STEM_WIDTH = 32
_C.MODEL.TRUNK.RESNET = CN()
# torchvision's name: resnet18/34/50/101/152, resnext50_32x4d, resnext101_32x8d/64x4d, wide_resnet50_2/101_2
_C.MODEL.TRUNK.RESNET.NAME = "resnet50"
_C.MODEL.TRUNK.RESNET.WIDTH_MULTIPLIER = 1.0  # scales every width (0.25: 16..512 channels for ResNet-50)
_C.MODEL.TRUNK.RESNET.SMALL_STEM = False  # 3x3 stride-1 stem without max pool, for small images
_C.MODEL.TRUNK.RESNET.ZERO_INIT_RESIDUAL = False  # last BatchNorm of each residual branch starts at 0
_C.MODEL.TRUNK.VIT = CN()
_C.MODEL.TRUNK.VIT.NAME = "small"  # tiny | small | base | large | huge | giant, or "custom" (dims below)
_C.MODEL.TRUNK.VIT.PATCH_SIZE = 16  # side of the square patches, in pixels
_C.MODEL.TRUNK.VIT.IMAGE_SIZE = 224  # position embeddings' image side (other sides: interpolated)
_C.MODEL.TRUNK.VIT.DEPTH = 0  # custom: encoder blocks
_C.MODEL.TRUNK.VIT.WIDTH = 0  # custom: token width, a multiple of HEADS
_C.MODEL.TRUNK.VIT.HEADS = 0  # custom: attention heads
_C.MODEL.TRUNK.VIT.MLP_RATIO = 4.0  # custom: MLP hidden width / WIDTH
_C.MODEL.TRUNK.VIT.CLASS_TOKEN = True  # prepend a learned class token (feature "cls")
_C.MODEL.TRUNK.VIT.POSITION_EMBEDDING = "learned"  # learned | sincos (fixed 2-D sin-cos: MAE, MoCo v3)
_C.MODEL.TRUNK.VIT.MASK_TOKEN = False  # a learned mask token for masked patches (iBOT, DINOv2)
_C.MODEL.TRUNK.VIT.FROZEN_PATCH_PROJECTION = False  # never train the random patch projection (MoCo v3)
# stochastic depth (Huang et al. 2016, as DeiT's and MAE's fine-tuning): in training each residual
# branch of block i (0-based, of D) is dropped per sample with probability DROP_PATH_RATE * i / (D - 1)
_C.MODEL.TRUNK.VIT.DROP_PATH_RATE = 0.0
# timm (pip install -e ".[timm]"): any timm.create_model name, built with num_classes=0
_C.MODEL.TRUNK.TIMM = CN()
_C.MODEL.TRUNK.TIMM.NAME = "vit_small_patch16_224"
_C.MODEL.TRUNK.TIMM.KWARGS = CN(new_allowed=True)  # its keyword arguments: img_size, drop_path_rate...
# class names of the model's blocks (sharded units, activation checkpoints); []: found from its
# structure (vistrain/models/trunks/structure.py), printed at build
_C.MODEL.TRUNK.TIMM.BLOCKS = []
# a learned mask token for masked patches (iBOT, DINOv2) of a timm VisionTransformer (as VIT.MASK_TOKEN)
_C.MODEL.TRUNK.TIMM.MASK_TOKEN = False
# torchvision: any classification builder of torchvision.models, its classifier's last layer removed
_C.MODEL.TRUNK.TORCHVISION = CN()
_C.MODEL.TRUNK.TORCHVISION.NAME = "resnet50"
_C.MODEL.TRUNK.TORCHVISION.KWARGS = CN(new_allowed=True)  # its keyword arguments (not weights)
_C.MODEL.TRUNK.TORCHVISION.BLOCKS = []  # as TIMM.BLOCKS
# features returned. RegNet: stem, s1..sK, avgpool; ResNet: conv1, res2..res5, avgpool; ViT: cls,
# avgpool (mean patch token), tokens (patch-token map), block1..blockD; timm: stage1..stageK
# (feature_info), avgpool (pooled; a token model's mean patch token), cls, tokens, sequence;
# torchvision: stage1..stageK (convolutional models), avgpool
_C.MODEL.TRUNK.OUT_FEATURES = ["avgpool"]

# The head: "identity" (the benchmarks' frozen trunk) or a method's (vistrain/methods/registry.py
# HEADS). Its default and the keys a head reads besides DIMS and USE_BN are declared with the
# methods (MODEL.HEAD.NMB_PROTOTYPES, OUT_DIM...: see get_defaults)
_C.MODEL.HEAD = CN()
_C.MODEL.HEAD.NAME = ""
_C.MODEL.HEAD.DIMS = [440, 512, 128]  # MLP dims: trunk output, hidden..., embedding
_C.MODEL.HEAD.USE_BN = True  # BatchNorm between MLP layers
# the trunk feature (one of MODEL.TRUNK.OUT_FEATURES) a head on one vector per image reads: "" its
# own (avgpool: the pooled map, a ViT's mean patch token); a ViT's "cls": its class token (DINO's
# and MoCo v3's authors). Heads on the token sequence (DINO's SEQUENCE, MAE) read "sequence"
_C.MODEL.HEAD.INPUT_FEATURE = ""

_C.MODEL.FSDP_CONFIG = CN()
_C.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP = False  # shard the model with the engine instead of DDP
_C.MODEL.FSDP_CONFIG.BACKEND = "builtin"  # builtin (vistrain.fsdp) | torch (torch's fully_shard)
_C.MODEL.FSDP_CONFIG.reshard_after_forward = True  # free gathered weights after forward (ZeRO-3)
_C.MODEL.FSDP_CONFIG.mixed_precision = False  # gather/compute in compute_dtype, fp32 master shards
_C.MODEL.FSDP_CONFIG.fp32_reduce_scatter = True  # reduce gradients in fp32 under mixed precision
_C.MODEL.FSDP_CONFIG.flatten_parameters = True  # one flat tensor per unit (per param group)
_C.MODEL.FSDP_CONFIG.compute_dtype = "bfloat16"  # float16 | bfloat16 (with mixed_precision)
_C.MODEL.FSDP_CONFIG.move_params_to_cpu = False  # keep shards and optimizer state in CPU memory
# hybrid sharding: 0 shards over all ranks; k > 0: groups of k consecutive ranks (a node) share the
# shards and the groups are replicas (one all-reduce of shard gradients across them); k | world size
_C.MODEL.FSDP_CONFIG.shard_group_size = 0
# Units: block (every trunk block: RegNet's and its stem, ResNet's, ViT's encoder blocks; each head
# MLP) | stage (every RegNet or ResNet stage instead of its blocks; a ViT's blocks) | model (none: one gather, one reduction per step). Fewer units: fewer collectives,
# more weights gathered at once; the same numbers.
_C.MODEL.FSDP_CONFIG.wrap_granularity = "block"
_C.MODEL.FSDP_CONFIG.prefetch_depth = 1  # next units whose gather starts early (each: one more gathered)
# Builtin backend: every unit also gathers its weights around each public method its module's class
# defines (trunk.forward_features(x), backbone.encode(...)), as around forward, with no
# register_forward_method line; an in-place write into the weights gathered for such a call lands in
# the shards (under mixed_precision it is an error naming the method) (docs/engine.md)
_C.MODEL.FSDP_CONFIG.GATHER_PUBLIC_METHODS = False
# Before building the model, choose the fastest setting of the knobs that do not change the
# numbers (wrap_granularity, reshard_after_forward, prefetch_depth, activation checkpointing, the
# step in backward, MACHINE.CPU_MMAP_THRESHOLD_MIB) whose planned peak fits MACHINE.MEMORY_BUDGET_MIB.
# Keys the recipe or the command line set are kept as set; config.yaml records what was chosen.
_C.MODEL.FSDP_CONFIG.AUTO_TUNE = False

# Image batches in channels_last (N, H, W, C) memory: the convolutions' native layout on CPU
# (oneDNN) and on tensor cores; the ELPV recipe's step ran 1.2x faster (docs/notes/elpv-recipe.md).
# Values equal to rounding; the trunk's weights keep their layout (the engine shards them flat).
_C.MODEL.CHANNELS_LAST = False
_C.MODEL.AMP_PARAMS = CN()
_C.MODEL.AMP_PARAMS.USE_AMP = False  # autocast the forward and the loss
_C.MODEL.AMP_PARAMS.AMP_DTYPE = "bfloat16"  # bfloat16 | float16 (float16 adds a grad scaler)
# float16's loss scaling (torch's GradScaler): the first scale; after GROWTH_INTERVAL steps without
# inf/NaN gradients it is multiplied by GROWTH_FACTOR, after a skipped step by BACKOFF_FACTOR
_C.MODEL.AMP_PARAMS.INIT_SCALE = 65536.0
_C.MODEL.AMP_PARAMS.GROWTH_FACTOR = 2.0
_C.MODEL.AMP_PARAMS.BACKOFF_FACTOR = 0.5
_C.MODEL.AMP_PARAMS.GROWTH_INTERVAL = 2000

_C.MODEL.SYNC_BN_CONFIG = CN()
_C.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN = False  # BatchNorm statistics over the global batch
_C.MODEL.SYNC_BN_CONFIG.GROUP_SIZE = 0  # 0: all ranks; k > 0: groups of k consecutive ranks

_C.MODEL.ACTIVATION_CHECKPOINTING = CN()
_C.MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING = False  # recompute in backward
_C.MODEL.ACTIVATION_CHECKPOINTING.GRANULARITY = "block"  # block | stage

_C.MODEL.WEIGHTS_INIT = CN()
_C.MODEL.WEIGHTS_INIT.PARAMS_FILE = ""  # checkpoint (folder or file) to initialise from
_C.MODEL.WEIGHTS_INIT.REMOVE_PREFIX = ""  # stripped from checkpoint keys
_C.MODEL.WEIGHTS_INIT.APPEND_PREFIX = ""  # prepended to checkpoint keys (after REMOVE_PREFIX)
_C.MODEL.WEIGHTS_INIT.SKIP_LAYERS = []  # key substrings not loaded (e.g. ["head."])

# ---------------------------------------------------------------------------------------------
_C.LOSS = CN()
# the method: a name of vistrain/methods/registry.py METHODS; each method declares its section
# LOSS.<name> (every key, its default and meaning) and LOSS.NAME's default in its own file
# (vistrain/methods/<method>.py: see get_defaults)
_C.LOSS.NAME = ""

# ---------------------------------------------------------------------------------------------
_C.OPTIMIZER = CN()
_C.OPTIMIZER.name = "sgd"  # sgd | lars | adamw
_C.OPTIMIZER.num_epochs = 10
_C.OPTIMIZER.momentum = 0.9
_C.OPTIMIZER.nesterov = False
_C.OPTIMIZER.weight_decay = 1e-4
_C.OPTIMIZER.betas = [0.9, 0.999]  # adamw
_C.OPTIMIZER.regularize_bn = False  # weight decay on BatchNorm parameters
_C.OPTIMIZER.regularize_bias = True  # weight decay on biases
_C.OPTIMIZER.head_lr_multiplier = 1.0  # learning rate of head parameters relative to the trunk
# parameters (name prefixes, e.g. head.predictor: SimSiam's --fix-pred-lr) trained at the schedule's
# peak lr throughout: no warm-up, no decay
_C.OPTIMIZER.fixed_lr_params = []
# finetune: layer-wise lr decay (BEiT, MAE): a parameter of trunk layer l of L (ViT: the patch
# embedding 0, block i i + 1, the last norm and the head L = depth + 1; RegNet / ResNet: the stem 0,
# stage k k) trains at lr * layer_decay ** (L - l). 1.0: off
_C.OPTIMIZER.layer_decay = 1.0
_C.OPTIMIZER.lars_eta = 0.001  # LARS trust coefficient
_C.OPTIMIZER.lars_exclude_bias_and_norm = True  # LARS: plain SGD for biases and norm layers
_C.OPTIMIZER.update_freq = 1  # gradient accumulation: optimizer step every N iterations
_C.OPTIMIZER.clip_grad_norm = 0.0  # > 0: clip the global gradient norm to this value
# with clip_grad_norm > 0: clip each parameter's gradient norm to it separately, DINO's
# clip_gradients (False: the norm of all gradients together, torch's clip_grad_norm_)
_C.OPTIMIZER.clip_grad_per_parameter = False
# Sharded engine: update each shard inside backward as soon as its gradient is reduced, then free
# that gradient (a rank never holds its whole gradient). Same numbers; no clip_grad_norm, no fp16.
_C.OPTIMIZER.step_in_backward = False
_C.OPTIMIZER.param_schedulers = CN()
_C.OPTIMIZER.param_schedulers.lr = CN()
_C.OPTIMIZER.param_schedulers.lr.name = "cosine"  # cosine | multistep | constant (warmup before any)
_C.OPTIMIZER.param_schedulers.lr.base_value = 0.1  # peak learning rate
_C.OPTIMIZER.param_schedulers.lr.end_value = 0.0  # cosine: final learning rate
_C.OPTIMIZER.param_schedulers.lr.warmup_epochs = 0.0  # linear warmup length (fractions allowed)
_C.OPTIMIZER.param_schedulers.lr.start_warmup_value = 0.0
_C.OPTIMIZER.param_schedulers.lr.milestones = [30, 60]  # multistep: epochs where lr *= gamma
_C.OPTIMIZER.param_schedulers.lr.gamma = 0.1
# the weight decay of the decaying groups: constant (OPTIMIZER.weight_decay throughout) | cosine
# (from OPTIMIZER.weight_decay at the first step to end_value at the last, no warm-up: DINO's
# weight-decay schedule, 0.04 -> 0.4)
_C.OPTIMIZER.param_schedulers.weight_decay = CN()
_C.OPTIMIZER.param_schedulers.weight_decay.name = "constant"
_C.OPTIMIZER.param_schedulers.weight_decay.end_value = 0.0  # cosine: the weight decay at the end
# The linear scaling rule (Goyal et al. 2017; MAE: lr = base lr x batch / 256): with auto_scale the
# schedule's values above (base_value, end_value, start_warmup_value) are the lr at
# base_lr_batch_size images and train at value x global batch / base_lr_batch_size, global batch =
# ranks x DATA.TRAIN.BATCHSIZE_PER_REPLICA x update_freq (pretraining, JOB train). VISSL's
# auto_lr_scaling, with its base_value the schedule's own.
_C.OPTIMIZER.param_schedulers.lr.auto_lr_scaling = CN()
_C.OPTIMIZER.param_schedulers.lr.auto_lr_scaling.auto_scale = False
_C.OPTIMIZER.param_schedulers.lr.auto_lr_scaling.base_lr_batch_size = 256

# ---------------------------------------------------------------------------------------------
_C.CHECKPOINT = CN()
_C.CHECKPOINT.DIR = "./checkpoints"  # run folder: checkpoints, config.yaml, metrics, TensorBoard
_C.CHECKPOINT.AUTO_RESUME = True  # continue from the latest complete checkpoint in DIR
_C.CHECKPOINT.CHECKPOINT_FREQUENCY = 1  # every N epochs (the last epoch is always saved)
_C.CHECKPOINT.CHECKPOINT_ITER_FREQUENCY = -1  # also every N iterations (-1: off)
_C.CHECKPOINT.KEEP_LAST = 3  # complete checkpoints kept (older ones deleted)
# A folder's checkpoints resume only under the schedule that made them (epochs, lr schedule and
# warm-up, global batch, augmentations, the method's settings, seed: vistrain/checkpoint/identity.py);
# another is refused in one line naming a free folder. True: train on from them under this config
_C.CHECKPOINT.ALLOW_OTHER_SCHEDULE = False
# SIGTERM or SIGUSR1 (a scheduler's preemption or time limit) stops every rank at the next iteration
# boundary and saves a checkpoint there; a step or save still running this long after the signal is
# abandoned (the previous checkpoint stands) and the job exits 143. Keep it below the scheduler's
# grace before SIGKILL (SLURM KillWait and Kubernetes: 30 s; or SLURM's --signal=USR1@<seconds>).
_C.CHECKPOINT.STOP_GRACE_SECONDS = 25.0
# After such a stop under SLURM, global rank 0 runs `scontrol requeue $SLURM_JOB_ID`: the job
# goes back to the queue and resumes from that checkpoint (sbatch --requeue must allow it).
_C.CHECKPOINT.SLURM_REQUEUE = False

# ---------------------------------------------------------------------------------------------
_C.BENCHMARK = CN()
# trunk outputs evaluated / extracted (stem, s1..s4, avgpool); "s2@4" pools that stage to 4 x 4
# instead of POOL_SIZE; "s3+avgpool" concatenates
_C.BENCHMARK.FEATURES = ["s3", "s4", "avgpool"]
_C.BENCHMARK.POOL_SIZE = 2  # stage maps are average-pooled to POOL_SIZE x POOL_SIZE, then flattened
# features averaged over transformed copies of each image: identity | flip (left-right) | dihedral
# (the 8 quarter turns and mirrors: for images with no "up", such as ELPV's cells)
_C.BENCHMARK.FEATURE_VIEWS = "identity"
# the frozen trunk's BatchNorm statistics: running (those it carries: the EMA of its training batches;
# a random trunk's init) | recompute (averaged over a pass of DATA.TRAIN's images and feature views,
# pretrained and random trunks alike: vistrain/benchmarks/precise_bn.py)
_C.BENCHMARK.TRUNK_BN_STATS = "running"
_C.BENCHMARK.LINEAR_LRS = []  # linear_eval: peak lrs tried per feature ([]: OPTIMIZER's lr only)
_C.BENCHMARK.LINEAR_HOLDOUT_FRACTION = 0.1  # linear_eval: part of TRAIN that picks the lr from LINEAR_LRS
_C.BENCHMARK.LINEAR_LR_FOLDS = 1  # linear_eval: > 1 picks the lr by stratified k-fold CV on TRAIN instead
# linear_eval: groups of classes scored as one too, "top1_<n>class": the group with the highest summed
# probability is right (ELPV's two classes: [[0, 1], [2, 3]], defective when p >= 0.5; []: none)
_C.BENCHMARK.CLASS_GROUPS = []
_C.BENCHMARK.KNN_K = 20  # kNN: neighbours voting
_C.BENCHMARK.KNN_TEMPERATURE = 0.07  # kNN: vote weight exp(sim / T)
_C.BENCHMARK.KNN_CHUNK_SIZE = 256  # kNN: test features compared per chunk (bounds memory)
_C.BENCHMARK.OUTPUT_DIR = ""  # extract_features: where features go ("" -> CHECKPOINT.DIR/features)
_C.BENCHMARK.EXTRACT_SPLITS = ["TRAIN", "TEST"]  # extract_features: DATA splits written (TRAIN and/or TEST)
# which network of a pretraining checkpoint the trunk is read from: student | teacher (the momentum
# teacher of DINO / BYOL, saved under "teacher.")
_C.BENCHMARK.WEIGHTS_FROM = "student"

# finetune: the trunk and a linear head trained end to end with the labels (vistrain/benchmarks/finetune.py)
_C.BENCHMARK.FINETUNE = CN()
# the trunk feature the head reads: a name of MODEL.TRUNK's features (avgpool, cls...) or "s4@2"
# (a map pooled to 2 x 2); it must use every trunk parameter (the last stage or block)
_C.BENCHMARK.FINETUNE.FEATURE = "avgpool"
_C.BENCHMARK.FINETUNE.LABEL_SMOOTHING = 0.0  # cross-entropy against (1 - e) one-hot + e / classes
# peak lrs tried on a held-out part of TRAIN ([]: OPTIMIZER's lr and num_epochs, no selection); the
# best (lr, epoch) on the held-out images is then trained on all of TRAIN, stopped at that epoch
_C.BENCHMARK.FINETUNE.LRS = []
_C.BENCHMARK.FINETUNE.HOLDOUT_FRACTION = 0.2  # part of TRAIN (stratified) that scores the LRS


# ---------------------------------------------------------------------------------------------
# Where a run's scalars and images go besides log.txt, metrics.jsonl and TensorBoard (CHECKPOINT.DIR/tb)
_C.LOGGING = CN()
# Weights & Biases (pip install "vistrain[wandb]"; vistrain/runtime/tracking.py): rank 0 mirrors
# every TensorBoard scalar and image to a W&B run kept in CHECKPOINT.DIR/wandb (a resumed run
# continues it)
_C.LOGGING.WANDB = CN()
_C.LOGGING.WANDB.ENABLED = False
_C.LOGGING.WANDB.PROJECT = "vistrain"
_C.LOGGING.WANDB.NAME = ""  # the W&B run's name ("": the run folder's name)
# online | offline (no network nor account; `wandb sync` uploads it later) | disabled | "" (wandb's
# default: the WANDB_MODE environment variable, else online)
_C.LOGGING.WANDB.MODE = ""


# ---------------------------------------------------------------------------------------------
# Watching a run learn (vistrain/training/monitor.py): every EVERY_EPOCHS epochs and after the last
# one, the trunk of the network BENCHMARK.WEIGHTS_FROM names (in eval mode, no gradients) reads
# held-out images; their kNN top-1, RankMe and feature std go to the log, metrics.jsonl,
# TensorBoard (monitor/...) and the run folder's monitor.png. The kNN is the knn job's: DATA.TEST
# against DATA.TRAIN's images read with DATA.TEST's transform, BENCHMARK.KNN_K / KNN_TEMPERATURE /
# KNN_CHUNK_SIZE.
_C.MONITOR = CN()
_C.MONITOR.EVERY_EPOCHS = 0  # 0: off
# trunk feature watched ("": the first MODEL.TRUNK.OUT_FEATURES; maps pooled to BENCHMARK.POOL_SIZE;
# a ViT's "sequence" read as its class token "cls", without one as its mean patch token "avgpool")
_C.MONITOR.FEATURE = ""
# kNN top-1 when DATA.TRAIN and DATA.TEST read the same sources and every image is labelled (else
# a note, and RankMe and feature std on NUM_IMAGES of DATA.TRAIN's images)
_C.MONITOR.KNN = True
_C.MONITOR.LABEL_FRACTION = (
    1.0  # the kNN bank: this stratified part of DATA.TRAIN (as the knn job's LABEL_FRACTION)
)
_C.MONITOR.NUM_IMAGES = (
    1024  # without kNN: DATA.TRAIN images (evenly spaced) that RankMe and feature std read
)
# images per rank in one extraction batch (0: DATA.TEST's BATCHSIZE_PER_REPLICA); a sharded trunk
# gathers each unit once per batch, so a small held-out set is read fastest in one batch per rank
_C.MONITOR.BATCHSIZE_PER_REPLICA = 0
# Collapse: RankMe below RANKME_MIN or 10x below its peak so far, or feature std below
# STD_MIN / sqrt(D) (D: the feature's width; ~1 / sqrt(D) when the features spread). One warning
# line; STOP_ON_COLLAPSE ends the run with exit 3, as a divergence does (the checkpoints are kept)
_C.MONITOR.RANKME_MIN = 1.5
_C.MONITOR.STD_MIN = 0.1
_C.MONITOR.STOP_ON_COLLAPSE = False
# Online linear probe (vistrain/training/online_probe.py), where the kNN runs: a linear classifier
# on the kNN bank's features (DATA.TRAIN's labelled images), warm-started and trained further at
# every pass, scored on DATA.TEST (probe_top1); its own generator and SGD: training unchanged
_C.MONITOR.ONLINE_PROBE = True
_C.MONITOR.PROBE_EPOCHS = 20  # epochs over the bank at each pass (batches of 256)
_C.MONITOR.PROBE_LR = 0.1  # its peak lr (SGD, momentum 0.9, no weight decay), cosine to 0 over each pass


# ---------------------------------------------------------------------------------------------
# Looking at a trained trunk: python tools/look.py RUN_FOLDER [map neighbours attention duplicates]
# (vistrain/benchmarks/look/). The run's own config and latest checkpoint; images of DATA.<SPLIT>
# read with DATA.TEST's transform, one process. Pictures and CSVs go to OUTPUT_DIR.
_C.LOOK = CN()
_C.LOOK.SPLIT = "TRAIN"  # the DATA split looked at: TRAIN | TEST
# the trunk feature embedded ("": MONITOR.FEATURE, else the first of MODEL.TRUNK.OUT_FEATURES)
_C.LOOK.FEATURE = ""
# images embedded, evenly spaced over the split (all of them when fewer): the map's t-SNE and the
# duplicate search compare every pair, N^2 (2,000 images: a few seconds on a CPU)
_C.LOOK.MAX_IMAGES = 2000
# the 2-D maps drawn side by side: pca | tsne (scikit-learn) | umap (needs umap-learn)
_C.LOOK.MAP_METHODS = ["pca", "tsne"]
_C.LOOK.THUMBNAILS = 40  # images drawn on each map, spread over it
# neighbours: query images (the first image of each class in turn; evenly spaced without labels)
_C.LOOK.QUERIES = 10
_C.LOOK.NEIGHBOURS = 8  # neighbours: nearest images shown per query
_C.LOOK.ATTENTION_IMAGES = 6  # attention: images drawn (a ViT's attention per head, a CNN's norm per stage)
# duplicates: pairs of images whose cosine similarity (features standardised over the images) is at
# least this are near-duplicates (1.0: identical features)
_C.LOOK.DUPLICATE_SIMILARITY = 0.98
_C.LOOK.OUTLIER_K = 5  # duplicates: an image's outlier score: its mean similarity to its K nearest
_C.LOOK.SHEET_ROWS = 4  # duplicates: rows of the sheet for the most similar pairs, and for the outliers
_C.LOOK.OUTPUT_DIR = ""  # "" -> CHECKPOINT.DIR/look (TensorBoard: CHECKPOINT.DIR/tb); set: all there (DIR/tb)


# The sections whose keys the methods declare (vistrain/methods, a layer above this one): LOSS.NAME's
# default and a LOSS.<name> section per method, MODEL.HEAD.NAME's default and the MODEL.HEAD keys of
# the methods' heads
METHOD_SECTIONS = ("LOSS", "MODEL.HEAD")


# keys that take another key's value when neither the recipe (with its _BASE_ chain) nor an override
# sets them (vistrain/config/loader.py load_config)
FOLLOWS = {"DATA.CHANNELS": "MODEL.TRUNK.IN_CHANNELS"}


def get_defaults(methods: Optional[CN] = None) -> CN:
    """A fresh, mutable copy of the default config.

    ``methods``: the keys the methods declare (``vistrain.methods.method_keys()``), a tree of the
    ``METHOD_SECTIONS``: its new keys are added, its NAMEs set the defaults. With them this is
    every key of a run (``vistrain.methods.get_defaults()``). Without them those two sections are
    held open: any key is accepted there as given, unchecked, and LOSS.NAME and MODEL.HEAD.NAME are
    empty: what the command line checks before it imports torch (vistrain/cli.py), never a run's
    config.
    """
    cfg = _C.clone()
    for path in METHOD_SECTIONS:
        section = _section(cfg, path)
        if methods is None:
            section.set_new_allowed(True)
            continue
        for key, value in _section(methods, path).items():
            if key in section and key != "NAME":
                raise ValueError(f"the methods declare {path}.{key}, a key of vistrain/config/defaults.py")
            section[key] = value.clone() if isinstance(value, CN) else copy.deepcopy(value)
    return cfg


def _section(cfg: CN, path: str) -> CN:
    for part in path.split("."):
        cfg = cfg[part]
    return cfg
