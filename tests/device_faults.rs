//! Device selection faults: with no GPU, `Device::auto()` falls back to the CPU (printing one
//! line why) instead of failing, and asking for CUDA explicitly is a typed error.

use grng::cuda::CudaDevice;
use grng::{Device, Error};

#[test]
fn auto_falls_back_to_the_cpu_without_a_gpu() {
    // Only meaningful with the selection left to `auto` (CI never sets GRNG_DEVICE).
    if std::env::var_os("GRNG_DEVICE").is_some() {
        return;
    }
    match (CudaDevice::new(0), Device::auto()) {
        (Ok(_), Ok(Device::Cuda(_))) => {}
        (Err(e), Ok(Device::Cpu)) => {
            assert!(matches!(e, Error::DeviceUnavailable(_)), "{e}");
        }
        (gpu, auto) => panic!("CudaDevice::new: {gpu:?}, Device::auto: {auto:?}"),
    }
}
