//! [`Nccl`]: the [`Communicator`] on NCCL (feature `nccl`), through cudarc's binding, which
//! loads `libnccl` at run time like the other CUDA libraries.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaStream, DeviceRepr};
use cudarc::nccl::safe::{Comm, Id, ReduceOp};
use cudarc::nccl::NcclType;

use super::{check_root, Communicator};
use crate::driver::CudaDevice;
use crate::error::{Error, Result};

/// One GPU's rank of an NCCL communicator. The collectives take host buffers (the
/// optimizers reduce host-packed payloads): each copies the buffer to the GPU, runs the NCCL
/// collective on the device's stream and copies the result back. NCCL's ring gives every
/// rank the same reduced bits.
///
/// Untested on hardware with more than one GPU (none was lent while this was written): the
/// world of one is tested where a GPU is present (`tests/dist_nccl.rs`).
pub struct Nccl {
    comm: Mutex<Comm>,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; every use
// goes through the mutex.
unsafe impl Send for Nccl {}
// SAFETY: as for `Send`.
unsafe impl Sync for Nccl {}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

fn nccl_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Communicator(format!("NCCL {what}: {e:?}"))
}

impl Nccl {
    /// A world of one on `device`.
    ///
    /// # Errors
    /// [`Error::Communicator`] when NCCL cannot be loaded or initialized.
    pub fn world_of_one(device: &CudaDevice) -> Result<Nccl> {
        let stream = device.stream().clone();
        let comm = Comm::from_devices(vec![stream.clone()])
            .map_err(|e| nccl_err("init", e))?
            .pop()
            .ok_or_else(|| nccl_err("init", "no communicator"))?;
        Ok(Self::with(comm, stream))
    }

    /// This process's rank of an NCCL communicator spanning the ranks of `bootstrap` (one
    /// GPU per rank, `device` this rank's): rank 0 makes NCCL's unique id and broadcasts it
    /// over `bootstrap` (MPI, typically), every rank then joins.
    ///
    /// # Errors
    /// [`Error::Communicator`] when NCCL cannot be loaded or initialized, or `bootstrap`
    /// fails.
    pub fn over(bootstrap: &dyn Communicator, device: &CudaDevice) -> Result<Nccl> {
        let mut id = [0.0f32; 128];
        if bootstrap.rank() == 0 {
            let made = Id::new().map_err(|e| nccl_err("unique id", e))?;
            for (d, &c) in id.iter_mut().zip(made.internal()) {
                *d = f32::from(c as u8);
            }
        }
        // A byte is exact in f32 (`c_char` is `i8` or `u8` by target: sent as its bits).
        bootstrap.broadcast(&mut id, 0)?;
        let internal = id.map(|c| c as u8 as std::ffi::c_char);
        let stream = device.stream().clone();
        let comm = Comm::from_rank(
            stream.clone(),
            bootstrap.rank(),
            bootstrap.size(),
            Id::uninit(internal),
        )
        .map_err(|e| nccl_err("init", e))?;
        Ok(Self::with(comm, stream))
    }

    fn with(comm: Comm, stream: Arc<CudaStream>) -> Nccl {
        let (rank, size) = (comm.rank(), comm.world_size());
        Nccl {
            comm: Mutex::new(comm),
            stream,
            rank,
            size,
        }
    }

    /// Copies `buf` to the GPU, runs `collective` on it there, and copies the result back.
    fn on_device<T: DeviceRepr + NcclType + Copy + Default>(
        &self,
        buf: &mut [T],
        collective: impl FnOnce(&Comm, &mut cudarc::driver::CudaSlice<T>) -> Result<()>,
    ) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let comm = self
            .comm
            .lock()
            .map_err(|_| Error::Communicator("a thread panicked inside NCCL".into()))?;
        let cuda = |e: cudarc::driver::DriverError| Error::Cuda(format!("{e:?}"));
        let mut dev = self.stream.clone_htod(&*buf).map_err(cuda)?;
        collective(&comm, &mut dev)?;
        self.stream.memcpy_dtoh(&dev, buf).map_err(cuda)?;
        self.stream.synchronize().map_err(cuda)
    }

    fn sum<T: DeviceRepr + NcclType + Copy + Default>(&self, buf: &mut [T]) -> Result<()> {
        self.on_device(buf, |comm, dev| {
            comm.all_reduce_in_place(dev, &ReduceOp::Sum)
                .map(|_| ())
                .map_err(|e| nccl_err("all-reduce", e))
        })
    }
}

impl Communicator for Nccl {
    rank_size_sums!();

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        check_root("Nccl::broadcast", root, self.size)?;
        self.on_device(buf, |comm, dev| {
            comm.broadcast_in_place(dev, root as i32)
                .map(|_| ())
                .map_err(|e| nccl_err("broadcast", e))
        })
    }

    fn barrier(&self) -> Result<()> {
        self.sum(&mut [0.0f32])
    }
}
