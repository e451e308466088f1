"""An Apex-era training script (the classic ``main.py --nodes --gpus --nr`` with amp).

It is written exactly as such scripts were, against ``apex.amp`` and ``apex.parallel``; the only
change is the two imports marked below. It trains a small ConvNet with batchnorm on
scikit-learn's 8x8 digits (shipped with scikit-learn: nothing is downloaded). Either its own
flags start the processes (``mp.spawn``, one per GPU, or CPU processes on gloo)::

    python examples/apex_legacy.py --nodes 1 --gpus 2 --nr 0 --opt-level O2

or a launcher does, as with ``python -m torch.distributed.launch`` in Apex's days::

    mpt launch --gpus 2 examples/apex_legacy.py --opt-level O2
"""
# ruff: noqa: UP032 - the script keeps its era's str.format, as users' copies have it

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

# was: from apex import amp
#      from apex.parallel import DistributedDataParallel as DDP
from mpt.compat.apex import amp
from mpt.compat.apex.parallel import DistributedDataParallel as DDP


class ConvNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, stride=1, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2))
        self.fc = nn.Linear(4 * 4 * 16, num_classes)

    def forward(self, x):
        out = self.layer1(x)
        out = out.reshape(out.size(0), -1)
        return self.fc(out)


def digits(seed=0):
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y)
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('-n', '--nodes', default=1, type=int, metavar='N')
    parser.add_argument('-g', '--gpus', default=1, type=int, help='number of gpus per node')
    parser.add_argument('-nr', '--nr', default=0, type=int, help='ranking within the nodes')
    parser.add_argument('--epochs', default=10, type=int, metavar='N')
    parser.add_argument('--opt-level', default='O2', type=str)
    parser.add_argument('--lr', default=0.05, type=float)
    parser.add_argument('--save', default='', type=str, help='checkpoint written at the end')
    parser.add_argument('--resume', default='', type=str, help='checkpoint to start from')
    args = parser.parse_args()
    if 'WORLD_SIZE' in os.environ:  # started by a launcher: one process is already us
        args.world_size = int(os.environ['WORLD_SIZE'])
        train(int(os.environ['LOCAL_RANK']), args, launched=True)
        return
    args.world_size = args.gpus * args.nodes
    os.environ.setdefault('MASTER_ADDR', '127.0.0.1')
    os.environ.setdefault('MASTER_PORT', '8888')
    mp.spawn(train, nprocs=args.gpus, args=(args,))


def train(gpu, args, launched=False):
    rank = int(os.environ['RANK']) if launched else args.nr * args.gpus + gpu
    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend='nccl' if use_cuda else 'gloo', init_method='env://',
                            world_size=args.world_size, rank=rank)
    torch.manual_seed(0)
    device = torch.device('cuda', gpu) if use_cuda else torch.device('cpu')
    if use_cuda:
        torch.cuda.set_device(gpu)
    model = ConvNet().to(device)
    batch_size = 32
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9)
    # Wrap the model
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      verbosity=int(rank == 0))
    model = DDP(model)
    start_epoch = 0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(checkpoint['model'])
        optimizer.load_state_dict(checkpoint['optimizer'])
        amp.load_state_dict(checkpoint['amp'])
        start_epoch = checkpoint['epoch']
        if rank == 0:
            print('Resumed at epoch {}, loss scale {}'.format(
                start_epoch, amp.state_dict()['loss_scaler0']['loss_scale']))
    # Data loading code
    train_dataset, test_dataset = digits()
    train_sampler = DistributedSampler(train_dataset, num_replicas=args.world_size, rank=rank)
    train_loader = DataLoader(dataset=train_dataset, batch_size=batch_size, shuffle=False,
                              num_workers=0, pin_memory=use_cuda, sampler=train_sampler)
    total_step = len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        for i, (images, labels) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            # Forward pass
            outputs = model(images)
            loss = criterion(outputs, labels)
            # Backward and optimize
            optimizer.zero_grad()
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            if (i + 1) == total_step and rank == 0:
                print('Epoch [{}/{}], Step [{}/{}], Loss: {:.4f}, loss scale {}'.format(
                    epoch + 1, args.epochs, i + 1, total_step, loss.item(),
                    amp.state_dict()['loss_scaler0']['loss_scale']))
    model.eval()
    correct = 0
    with torch.no_grad():
        x, y = test_dataset.tensors
        correct = (model(x.to(device)).argmax(dim=1) == y.to(device)).sum().item()
    if rank == 0:
        print('Accuracy: {:.2f}%'.format(100.0 * correct / len(test_dataset)))
        print('Master weights dtype: {}, model weights dtype: {}'.format(
            next(amp.master_params(optimizer)).dtype, model.module.fc.weight.dtype))
    if rank == 0 and args.save:
        checkpoint = {'model': model.module.state_dict(), 'optimizer': optimizer.state_dict(),
                      'amp': amp.state_dict(), 'epoch': args.epochs}
        torch.save(checkpoint, args.save)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
