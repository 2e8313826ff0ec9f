//! CUDA graphs on the runtime's stream: capture, instantiate, replay (the
//! engine's decode steps).

use super::{drv, shape, Gpu};
use crate::error::{CudaError, Result};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// A captured and instantiated CUDA graph (the engine's decode steps),
/// replayed on the stream it was captured from.
pub struct Graph {
    graph: cudarc::driver::sys::CUgraph,
    exec: cudarc::driver::sys::CUgraphExec,
    stream: Arc<CudaStream>,
}

// SAFETY: the handles are plain driver objects, valid on any thread with the
// context bound (every call binds it); a graph is used by one thread at a
// time (the owner of the model), never concurrently.
unsafe impl Send for Graph {}

impl Graph {
    /// Replays the graph.
    pub fn launch(&self) -> Result<()> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(drv("cuCtxSetCurrent"))?;
        // SAFETY: exec and stream are live (the graph holds the stream).
        unsafe { cudarc::driver::result::graph::launch(self.exec, self.stream.cu_stream()) }
            .map_err(drv("cuGraphLaunch"))
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        use cudarc::driver::result::graph;
        let ctx = self.stream.context();
        ctx.record_err(ctx.bind_to_thread());
        // SAFETY: created by instantiate / end_capture, destroyed once.
        unsafe {
            let _ = graph::exec_destroy(self.exec);
            let _ = graph::destroy(self.graph);
        }
    }
}

impl Gpu {
    /// Whether graphs can hold this device's allocations: stream-ordered
    /// allocation (memory pools), which a capture records as memory nodes.
    pub fn can_capture(&self) -> bool {
        self.device.ctx.has_async_alloc()
    }

    /// Starts capturing the stream's work into a graph instead of running
    /// it. Thread-local mode: a call that cannot be captured (a synchronous
    /// allocation or copy) fails the capture instead of running outside it.
    pub fn begin_capture(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: the stream is live and not capturing (end_capture always
        // ends a capture).
        unsafe {
            cudarc::driver::result::stream::begin_capture(
                self.stream.cu_stream(),
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(drv("cuStreamBeginCapture"))
    }

    /// Ends the capture and instantiates the graph, its resources uploaded.
    /// Call it after every [`Gpu::begin_capture`], also when the captured
    /// work failed: the capture is ended whatever happened (an error a drop
    /// stored meanwhile, such as a free the capture refused, is reported,
    /// not allowed to skip the end), so the stream runs work again.
    pub fn end_capture(&self) -> Result<Graph> {
        use cudarc::driver::result::{graph, stream};
        use cudarc::driver::sys;
        let stored = self.device.ctx.check_err();
        // SAFETY: the stream is live; ending a capture that was invalidated
        // returns an error and leaves capture mode.
        let ended = unsafe { stream::end_capture(self.stream.cu_stream()) };
        let g = ended.map_err(|e| CudaError::Driver {
            call: "cuStreamEndCapture",
            message: match &stored {
                Ok(()) => format!("{e:?}"),
                Err(s) => format!("{e:?} (and during the capture: {s:?})"),
            },
        })?;
        if g.is_null() {
            return Err(shape("graph", "the capture recorded nothing".into()));
        }
        let destroy = |e: CudaError| {
            // SAFETY: g came from end_capture and is destroyed once.
            let _ = unsafe { graph::destroy(g) };
            e
        };
        stored.map_err(drv("during the capture")).map_err(destroy)?;
        // SAFETY: g is a valid captured graph.
        let exec = unsafe { graph::instantiate(g, sys::CUgraphInstantiate_flags(0)) }
            .map_err(drv("cuGraphInstantiate"))
            .map_err(destroy)?;
        let out = Graph {
            graph: g,
            exec,
            stream: self.stream.clone(),
        };
        // SAFETY: exec and stream are live.
        unsafe { graph::upload(out.exec, self.stream.cu_stream()) }
            .map_err(drv("cuGraphUpload"))?;
        Ok(out)
    }
}
