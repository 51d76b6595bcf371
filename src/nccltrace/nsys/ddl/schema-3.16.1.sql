-- nsys SQLite export DDL subset, export schema 3.16.1 (Nsight Systems 2024.6.2.225), DERIVED.
-- No complete real DDL of 3.16.1 is available. Statements are the verbatim 3.0.0 statements
-- (see schema-3.0.0.sql) with only these documented changes applied:
--   * CUPTI_ACTIVITY_KIND_KERNEL: + greenContextId (nullable INTEGER) between contextId and streamId;
--     launchType comment now references ENUM_CUDA_KERNEL_LAUNCH_TYPE.
--   * NVTX_EVENTS: + binaryData (declared TEXT as documented; holds a BLOB) after jsonText.
--   * EXPORT_META_DATA renamed META_DATA_EXPORT (same columns).
--   * ENUM_CUDA_KRENEL_LAUNCH_TYPE renamed ENUM_CUDA_KERNEL_LAUNCH_TYPE. Assumption: the spelling fix
--     is only documented as "later than 3.0.0"; nccltrace applies it from 3.16.1 (readers accept both).
--   * NVTX_PAYLOAD_SCHEMAS / _SCHEMA_ENTRIES / _ENUMS / _ENUM_ENTRIES: column names from the 3.28.1
--     documentation. Assumption: whether 3.16.1 has these tables is not established; nccltrace
--     includes them because binaryData cannot be decoded without the schemas.
-- Column types of new columns follow the documentation where it states them (binaryData TEXT);
-- otherwise they are INTEGER (TEXT for names), nullable except key columns. The comments on new
-- columns are nccltrace's own wording, not NVIDIA's. Unchanged statements are verbatim 3.0.0 text.
-- ENUM rows are the 3.0.0 rows (newer exporters have more ENUM_NSYS_EVENT_TYPE rows).

CREATE TABLE StringIds (
    -- Consolidation of repetitive string values.

    id                          INTEGER   NOT NULL   PRIMARY KEY,      -- ID reference value.
    value                       TEXT      NOT NULL                     -- String value.
);
CREATE TABLE TARGET_INFO_SYSTEM_ENV (
    globalVid                   INTEGER   NOT NULL,                    -- Serialized GlobalId.
    devStateName                TEXT      NOT NULL,                    -- Device state name.
    name                        TEXT      NOT NULL,                    -- Property name.
    nameEnum                    INTEGER   NOT NULL,                    -- Property enum value.
    value                       TEXT      NOT NULL                     -- Property value.
);
CREATE TABLE TARGET_INFO_SESSION_START_TIME (
    utcEpochNs                  INTEGER,                               -- UTC Epoch timestamp at start of the capture (ns).
    utcTime                     TEXT,                                  -- Start of the capture in UTC.
    localTime                   TEXT                                   -- Start of the capture in local time of target.
);
CREATE TABLE ANALYSIS_DETAILS (
    -- Details about the analysis session.

    globalVid                   INTEGER   NOT NULL,                    -- Serialized GlobalId.
    duration                    INTEGER   NOT NULL,                    -- The total time span of the entire trace (ns).
    startTime                   INTEGER   NOT NULL,                    -- Trace start timestamp in nanoseconds.
    stopTime                    INTEGER   NOT NULL                     -- Trace stop timestamp in nanoseconds.
);
CREATE TABLE PROCESSES (
    -- Names and identifiers of processes captured in the report.

    globalPid                   INTEGER,                               -- Serialized GlobalId.
    pid                         INTEGER,                               -- The process ID.
    name                        TEXT                                   -- The process name.
);
CREATE TABLE ThreadNames (
    nameId                      INTEGER   NOT NULL,                    -- REFERENCES StringIds(id) -- Thread name
    priority                    INTEGER,                               -- Priority of the thread.
    globalTid                   INTEGER                                -- Serialized GlobalId.
);
CREATE TABLE TARGET_INFO_GPU (
    vmId                        INTEGER   NOT NULL,                    -- Serialized GlobalId.
    id                          INTEGER   NOT NULL,                    -- Device ID.
    name                        TEXT,                                  -- Device name.
    busLocation                 TEXT,                                  -- PCI bus location.
    isDiscrete                  INTEGER,                               -- True if discrete, false if integrated.
    l2CacheSize                 INTEGER,                               -- Size of L2 cache (B).
    totalMemory                 INTEGER,                               -- Total amount of memory on the device (B).
    memoryBandwidth             INTEGER,                               -- Amount of memory transferred (B).
    clockRate                   INTEGER,                               -- Clock frequency (Hz).
    smCount                     INTEGER,                               -- Number of multiprocessors on the device.
    pwGpuId                     INTEGER,                               -- PerfWorks GPU ID.
    uuid                        TEXT,                                  -- Device UUID.
    luid                        INTEGER,                               -- Device LUID.
    chipName                    TEXT,                                  -- Chip name.
    cuDevice                    INTEGER,                               -- CUDA device ID.
    ctxswDevPath                TEXT,                                  -- GPU context switch device node path.
    ctrlDevPath                 TEXT,                                  -- GPU control device node path.
    revision                    INTEGER,                               -- Revision number.
    nodeMask                    INTEGER,                               -- Device node mask.
    constantMemory              INTEGER,                               -- Memory available on device for __constant__ variables (B).
    maxIPC                      INTEGER,                               -- Maximum instructions per count.
    maxRegistersPerBlock        INTEGER,                               -- Maximum number of 32-bit registers available per block.
    maxShmemPerBlock            INTEGER,                               -- Maximum optin shared memory per block.
    maxShmemPerBlockOptin       INTEGER,                               -- Maximum optin shared memory per block.
    maxShmemPerSm               INTEGER,                               -- Maximum shared memory available per multiprocessor (B).
    maxRegistersPerSm           INTEGER,                               -- Maximum number of 32-bit registers available per multiprocessor.
    threadsPerWarp              INTEGER,                               -- Warp size in threads.
    asyncEngines                INTEGER,                               -- Number of asynchronous engines.
    maxWarpsPerSm               INTEGER,                               -- Maximum number of warps per multiprocessor.
    maxBlocksPerSm              INTEGER,                               -- Maximum number of blocks per multiprocessor.
    maxThreadsPerBlock          INTEGER,                               -- Maximum number of threads per block.
    maxBlockDimX                INTEGER,                               -- Maximum X-dimension of a block.
    maxBlockDimY                INTEGER,                               -- Maximum Y-dimension of a block.
    maxBlockDimZ                INTEGER,                               -- Maximum Z-dimension of a block.
    maxGridDimX                 INTEGER,                               -- Maximum X-dimension of a grid.
    maxGridDimY                 INTEGER,                               -- Maximum Y-dimension of a grid.
    maxGridDimZ                 INTEGER,                               -- Maximum Z-dimension of a grid.
    computeMajor                INTEGER,                               -- Major compute capability version number.
    computeMinor                INTEGER,                               -- Minor compute capability version number.
    smMajor                     INTEGER,                               -- Major multiprocessor version number.
    smMinor                     INTEGER                                -- Minor multiprocessor version number.
);
CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (
    start                       INTEGER   NOT NULL,                    -- Event start timestamp (ns).
    end                         INTEGER   NOT NULL,                    -- Event end timestamp (ns).
    eventClass                  INTEGER   NOT NULL,                    -- REFERENCES ENUM_NSYS_EVENT_CLASS(id)
    globalTid                   INTEGER,                               -- Serialized GlobalId.
    correlationId               INTEGER,                               -- ID used to identify events that this function call has triggered.
    nameId                      INTEGER   NOT NULL,                    -- REFERENCES StringIds(id) -- Function name
    returnValue                 INTEGER   NOT NULL,                    -- Return value of the function call.
    callchainId                 INTEGER                                -- REFERENCES CUDA_CALLCHAINS(id)
);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (
    start                       INTEGER   NOT NULL,                    -- Event start timestamp (ns).
    end                         INTEGER   NOT NULL,                    -- Event end timestamp (ns).
    deviceId                    INTEGER   NOT NULL,                    -- Device ID.
    contextId                   INTEGER   NOT NULL,                    -- Context ID.
    greenContextId              INTEGER,                               -- Green context ID (derived column; see header).
    streamId                    INTEGER   NOT NULL,                    -- Stream ID.
    correlationId               INTEGER,                               -- REFERENCES CUPTI_ACTIVITY_KIND_RUNTIME(correlationId)
    globalPid                   INTEGER,                               -- Serialized GlobalId.
    demangledName               INTEGER   NOT NULL,                    -- REFERENCES StringIds(id) -- Kernel function name w/ templates
    shortName                   INTEGER   NOT NULL,                    -- REFERENCES StringIds(id) -- Base kernel function name
    mangledName                 INTEGER,                               -- REFERENCES StringIds(id) -- Raw C++ mangled kernel function name
    launchType                  INTEGER,                               -- REFERENCES ENUM_CUDA_KERNEL_LAUNCH_TYPE(id)
    cacheConfig                 INTEGER,                               -- REFERENCES ENUM_CUDA_FUNC_CACHE_CONFIG(id)
    registersPerThread          INTEGER   NOT NULL,                    -- Number of registers required for each thread executing the kernel.
    gridX                       INTEGER   NOT NULL,                    -- X-dimension grid size.
    gridY                       INTEGER   NOT NULL,                    -- Y-dimension grid size.
    gridZ                       INTEGER   NOT NULL,                    -- Z-dimension grid size.
    blockX                      INTEGER   NOT NULL,                    -- X-dimension block size.
    blockY                      INTEGER   NOT NULL,                    -- Y-dimension block size.
    blockZ                      INTEGER   NOT NULL,                    -- Z-dimension block size.
    staticSharedMemory          INTEGER   NOT NULL,                    -- Static shared memory allocated for the kernel (B).
    dynamicSharedMemory         INTEGER   NOT NULL,                    -- Dynamic shared memory reserved for the kernel (B).
    localMemoryPerThread        INTEGER   NOT NULL,                    -- Amount of local memory reserved for each thread (B).
    localMemoryTotal            INTEGER   NOT NULL,                    -- Total amount of local memory reserved for the kernel (B).
    gridId                      INTEGER   NOT NULL,                    -- Unique grid ID of the kernel assigned at runtime.
    sharedMemoryExecuted        INTEGER,                               -- Shared memory size set by the driver.
    graphNodeId                 INTEGER,                               -- REFERENCES CUDA_GRAPH_EVENTS(graphNodeId)
    sharedMemoryLimitConfig     INTEGER                                -- REFERENCES ENUM_CUDA_SHARED_MEM_LIMIT_CONFIG(id)
);
CREATE TABLE NVTX_EVENTS (
    start                       INTEGER   NOT NULL,                    -- Event start timestamp (ns).
    end                         INTEGER,                               -- Event end timestamp (ns).
    eventType                   INTEGER   NOT NULL,                    -- REFERENCES ENUM_NSYS_EVENT_TYPE(id)
    rangeId                     INTEGER,                               -- Correlation ID returned from a nvtxRangeStart call.
    category                    INTEGER,                               -- User-controlled ID that can be used to group events.
    color                       INTEGER,                               -- Encoded ARGB color value.
    text                        TEXT,                                  -- Optional text message for non registered strings.
    globalTid                   INTEGER,                               -- Serialized GlobalId.
    endGlobalTid                INTEGER,                               -- Serialized GlobalId.
    textId                      INTEGER,                               -- REFERENCES StringIds(id) -- Registered NVTX domain
    domainId                    INTEGER,                               -- User-controlled ID that can be used to group events.
    uint64Value                 INTEGER,                               -- One of possible payload value union members.
    int64Value                  INTEGER,                               -- One of possible payload value union members.
    doubleValue                 REAL,                                  -- One of possible payload value union members.
    uint32Value                 INTEGER,                               -- One of possible payload value union members.
    int32Value                  INTEGER,                               -- One of possible payload value union members.
    floatValue                  REAL,                                  -- One of possible payload value union members.
    jsonTextId                  INTEGER,                               -- One of possible payload value union members.
    jsonText                    TEXT,                                  -- One of possible payload value union members.
    binaryData                  TEXT                                   -- NVTX extended payload bytes (declared TEXT, stored as BLOB).
);
CREATE TABLE NVTX_PAYLOAD_SCHEMAS (
    -- NVTX extended payload schemas registered per domain.

    domainId                    INTEGER   NOT NULL,                    -- NVTX domain ID (per process).
    schemaId                    INTEGER   NOT NULL,                    -- Payload schema ID.
    name                        TEXT,                                  -- Schema name.
    type                        INTEGER,                               -- Schema type (1 static, 2 dynamic, ...).
    flags                       INTEGER,                               -- Schema flags.
    numEntries                  INTEGER,                               -- Number of entries.
    payloadSize                 INTEGER,                               -- Static payload size (B).
    alignTo                     INTEGER                                -- Pack alignment (B).
);
CREATE TABLE NVTX_PAYLOAD_SCHEMA_ENTRIES (
    -- Entries of the NVTX extended payload schemas.

    domainId                    INTEGER   NOT NULL,                    -- NVTX domain ID (per process).
    schemaId                    INTEGER   NOT NULL,                    -- Payload schema ID.
    idx                         INTEGER   NOT NULL,                    -- Zero-based entry index.
    flags                       INTEGER,                               -- Entry flags.
    type                        INTEGER,                               -- Entry type (predefined type or schema/enum ID).
    name                        TEXT,                                  -- Entry name.
    description                 TEXT,                                  -- Entry description.
    arrayOrUnionDetail          INTEGER,                               -- Array length or union selector.
    offset                      INTEGER                                -- Byte offset in the payload.
);
CREATE TABLE NVTX_PAYLOAD_ENUMS (
    -- NVTX extended payload enums registered per domain.

    domainId                    INTEGER   NOT NULL,                    -- NVTX domain ID (per process).
    schemaId                    INTEGER   NOT NULL,                    -- Enum schema ID.
    name                        TEXT,                                  -- Enum name.
    numEntries                  INTEGER,                               -- Number of enum values.
    size                        INTEGER                                -- Size of the enum type (B).
);
CREATE TABLE NVTX_PAYLOAD_ENUM_ENTRIES (
    -- Values of the NVTX extended payload enums.

    domainId                    INTEGER   NOT NULL,                    -- NVTX domain ID (per process).
    schemaId                    INTEGER   NOT NULL,                    -- Enum schema ID.
    idx                         INTEGER   NOT NULL,                    -- Zero-based value index.
    name                        TEXT,                                  -- Value name.
    value                       INTEGER,                               -- Numeric value.
    isFlag                      INTEGER                                -- True if the value is a flag.
);
CREATE TABLE ENUM_NSYS_EVENT_TYPE (
    -- Nsys event type labels

    id                          INTEGER   NOT NULL   PRIMARY KEY,      -- Enum numerical value
    name                        TEXT,                                  -- Enum symbol name
    label                       TEXT                                   -- Enum human name
);
CREATE TABLE ENUM_NSYS_EVENT_CLASS (
    -- Nsys event class labels

    id                          INTEGER   NOT NULL   PRIMARY KEY,      -- Enum numerical value
    name                        TEXT,                                  -- Enum symbol name
    label                       TEXT                                   -- Enum human name
);
CREATE TABLE ENUM_CUDA_KERNEL_LAUNCH_TYPE (
    -- CUDA kernel launch type labels

    id                          INTEGER   NOT NULL   PRIMARY KEY,      -- Enum numerical value
    name                        TEXT,                                  -- Enum symbol name
    label                       TEXT                                   -- Enum human name
);
CREATE TABLE ENUM_CUDA_FUNC_CACHE_CONFIG (
    -- CUDA function cache config labels

    id                          INTEGER   NOT NULL   PRIMARY KEY,      -- Enum numerical value
    name                        TEXT,                                  -- Enum symbol name
    label                       TEXT                                   -- Enum human name
);
CREATE TABLE ENUM_CUDA_SHARED_MEM_LIMIT_CONFIG (
    -- CUDA shared memory limit config labels

    id                          INTEGER   NOT NULL   PRIMARY KEY,      -- Enum numerical value
    name                        TEXT,                                  -- Enum symbol name
    label                       TEXT                                   -- Enum human name
);
CREATE TABLE META_DATA_EXPORT (
    -- information about nsys export process

    name                        TEXT      NOT NULL,                    -- Name of export meta-data record
    value                       TEXT                                   -- Value of export meta-data record
);
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(0, 'Unknown', 'Unknown');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(1, 'CpuCycles', 'CpuCycles');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(2, 'Instructions', 'Instructions');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(3, 'CacheReferences', 'CacheReferences');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(4, 'L1CacheDataWriteMisses', 'L1CacheDataWriteMisses');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(5, 'L1CacheDataReadMisses', 'L1CacheDataReadMisses');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(6, 'L1CacheInstructionMisses', 'L1CacheInstructionMisses');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(7, 'L2CacheDataWriteMisses', 'L2CacheDataWriteMisses');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(8, 'L2CacheDataReadMisses', 'L2CacheDataReadMisses');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(9, 'L2CacheInstructionMisses', 'L2CacheInstructionMisses');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(10, 'BranchInstructions', 'BranchInstructions');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(11, 'BranchMisses', 'BranchMisses');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(12, 'BusCycles', 'BusCycles');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(13, 'CpuClock', 'CpuClock');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(14, 'TaskClock', 'TaskClock');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(15, 'PageFault', 'PageFault');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(16, 'ContextSwitches', 'ContextSwitches');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(17, 'CpuMigrations', 'CpuMigrations');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(18, 'PageFaultsMin', 'PageFaultsMin');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(19, 'PageFaultsMax', 'PageFaultsMax');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(20, 'AlignmentFaults', 'AlignmentFaults');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(21, 'EmulationFaults', 'EmulationFaults');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(22, 'ThreadState', 'ThreadState');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(23, 'Frames', 'Frames');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(24, 'Annotations', 'Annotations');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(25, 'SchedSwitch', 'SchedSwitch');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(26, 'SchedWakeup', 'SchedWakeup');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(27, 'Command', 'Command');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(28, 'Mmap', 'Mmap');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(29, 'MemUsage', 'MemUsage');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(30, 'Emc', 'Emc');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(31, 'Composite', 'Composite');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(32, 'NvtxEvents', 'NvtxEvents');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(33, 'NvtxCategory', 'NvtxCategory');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(34, 'NvtxMark', 'NvtxMark');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(35, 'NvtxPushRange', 'NvtxPushRange');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(36, 'NvtxPopRange', 'NvtxPopRange');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(37, 'NvtxStartRange', 'NvtxStartRange');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(38, 'NvtxEndRange', 'NvtxEndRange');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(39, 'NvtxThread', 'NvtxThread');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(40, 'PowerRate', 'PowerRate');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(41, 'Sched', 'Sched');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(42, 'CpuCyclesSelf', 'CpuCyclesSelf');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(43, 'CpuCyclesTotal', 'CpuCyclesTotal');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(44, 'CpuCyclesSelfPlus', 'CpuCyclesSelfPlus');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(45, 'Cuda', 'Cuda');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(46, 'CudaDevice', 'CudaDevice');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(47, 'TraceProcess', 'TraceProcess');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(48, 'TraceFunctions', 'TraceFunctions');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(49, 'Diagnostic', 'Diagnostic');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(50, 'GlWorkload', 'GlWorkload');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(51, 'BandwidthUsage', 'BandwidthUsage');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(52, 'KhrDebugMark', 'KhrDebugMark');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(53, 'KhrDebugPushRange', 'KhrDebugPushRange');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(54, 'KhrDebugPopRange', 'KhrDebugPopRange');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(55, 'KhrDebugGpuMark', 'KhrDebugGpuMark');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(56, 'KhrDebugGpuPushRange', 'KhrDebugGpuPushRange');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(57, 'KhrDebugGpuPopRange', 'KhrDebugGpuPopRange');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(58, 'GpuCtxsw', 'GpuCtxsw');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(59, 'NvtxPushPopRange', 'NvtxPushPopRange');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(60, 'NvtxStartEndRange', 'NvtxStartEndRange');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(61, 'ProfTime', 'ProfTime');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(62, 'KhrDebugPushPopRange', 'KhrDebugPushPopRange');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(63, 'KhrDebugGpuPushPopRange', 'KhrDebugGpuPushPopRange');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(64, 'NvtxtCategory', 'NvtxtCategory');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(65, 'NvtxtMark', 'NvtxtMark');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(66, 'NvtxtPushRange', 'NvtxtPushRange');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(67, 'NvtxtPopRange', 'NvtxtPopRange');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(68, 'NvtxtStartRange', 'NvtxtStartRange');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(69, 'NvtxtEndRange', 'NvtxtEndRange');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(70, 'NvtxtPushPopRange', 'NvtxtPushPopRange');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(71, 'NvtxtStartEndRange', 'NvtxtStartEndRange');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(72, 'NvtxtMetaThread', 'NvtxtMetaThread');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(73, 'NvtxtMetaProcess', 'NvtxtMetaProcess');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(74, 'NvtxtMetaFileDisplay', 'NvtxtMetaFileDisplay');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(75, 'NvtxDomainCreate', 'NvtxDomainCreate');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(76, 'NvtxDomainDestroy', 'NvtxDomainDestroy');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(77, 'NvnGpuCmdBuf', 'NvnGpuCmdBuf');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(78, 'TraceVSync', 'TraceVSync');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(79, 'CudaDeviceKernel', 'CudaDeviceKernel');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(80, 'CudaDeviceMemory', 'CudaDeviceMemory');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(81, 'Pmu', 'Pmu');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(82, 'NvnGpuDraw', 'NvnGpuDraw');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(83, 'NvnGpuCompute', 'NvnGpuCompute');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(84, 'NvnGpuDebug', 'NvnGpuDebug');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(85, 'OS runtime libraries', 'OS runtime libraries');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(86, 'CuDNN', 'CuDNN');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(87, 'CuBLAS', 'CuBLAS');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(88, 'NvMedia', 'NvMedia');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(89, 'OpenACC', 'OpenACC');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(90, 'Correlation', 'Correlation');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(91, 'DX12', 'DX12');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(92, 'DX12Workload', 'DX12Workload');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(93, 'PmuRawEvent', 'PmuRawEvent');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(94, 'GraphicsFrame', 'GraphicsFrame');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(95, 'Vulkan', 'Vulkan');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(96, 'VulkanWorkload', 'VulkanWorkload');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(97, 'NvtxNameCudaDevice', 'NvtxNameCudaDevice');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(98, 'NvtxNameCudaContext', 'NvtxNameCudaContext');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(99, 'NvtxNameCudaStream', 'NvtxNameCudaStream');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(100, 'SystemEvent', 'SystemEvent');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(101, 'GpuMemoryEvent', 'GpuMemoryEvent');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(102, 'DX12CreateObject', 'DX12CreateObject');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(103, 'VulkanCreateObject', 'VulkanCreateObject');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(104, 'UnitTraceEvent', 'UnitTraceEvent');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(105, 'CustomETWEvent', 'CustomETWEvent');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(106, 'CudaSyncEvent', 'CudaSyncEvent');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(107, 'SLIEvent', 'SLIEvent');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(108, 'CudaBacktrace', 'CudaBacktrace');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(109, 'WddmEvent', 'WddmEvent');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(110, 'DX11', 'DX11');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(111, 'DX11CreateObject', 'DX11CreateObject');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(112, 'DXGI', 'DXGI');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(113, 'CudaGraphNodeCreation', 'CudaGraphNodeCreation');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(114, 'OpenMP', 'OpenMP');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(115, 'UncorePmuEvent', 'UncorePmuEvent');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(116, 'UncorePmuCarmel', 'UncorePmuCarmel');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(117, 'CudaDeviceMemoryUsage', 'CudaDeviceMemoryUsage');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(118, 'ETWDxgKrnlEvent', 'ETWDxgKrnlEvent');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(119, 'CudaUvmCpuPageFaultEvent', 'CudaUvmCpuPageFaultEvent');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(120, 'CudaUvmGpuPageFaultEvent', 'CudaUvmGpuPageFaultEvent');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(121, 'NICMetricsValuesEvent', 'NICMetricsValuesEvent');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(122, 'NICMetricsListEvent', 'NICMetricsListEvent');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(123, 'InterruptHandler', 'InterruptHandler');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(124, 'NVENC', 'NVENC');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(125, 'NVDEC', 'NVDEC');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(126, 'nvJPEG', 'nvJPEG');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(127, 'CudaEventRecord', 'CudaEventRecord');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(128, 'PerfEventCountEvent', 'PerfEventCountEvent');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(129, 'CudaDeviceMemoryPool', 'CudaDeviceMemoryPool');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(130, 'CudaDeviceGraph', 'CudaDeviceGraph');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(131, 'CudaGraphExecCreation', 'CudaGraphExecCreation');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(132, 'CudaGraphCreation', 'CudaGraphCreation');
INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES(133, 'CudaGraphClone', 'CudaGraphClone');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(0, 'TRACE_PROCESS_EVENT_CUDA_RUNTIME', 'CUDA runtime');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(1, 'TRACE_PROCESS_EVENT_CUDA_DRIVER', 'CUDA driver');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(2, 'TRACE_PROCESS_EVENT_GL', 'GL');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(3, 'TRACE_PROCESS_EVENT_TSP_OVERHEAD', 'TSP overhead');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(4, 'TRACE_PROCESS_EVENT_GL_DEBUG', 'GL debug');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(5, 'TRACE_PROCESS_EVENT_GL_WORKLOAD', 'GL workload');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(6, 'TRACE_PROCESS_EVENT_NVTX_START', 'NVTX start');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(7, 'TRACE_PROCESS_EVENT_NVTX_FINISH', 'NVTX finish');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(8, 'TRACE_PROCESS_EVENT_GL_START', 'GL start');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(9, 'TRACE_PROCESS_EVENT_GL_FINISH', 'GL finish');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(10, 'TRACE_PROCESS_EVENT_CUDA_START', 'CUDA start');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(11, 'TRACE_PROCESS_EVENT_CUDA_FINISH', 'CUDA finish');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(12, 'TRACE_PROCESS_EVENT_CUDA_INIT_ERROR', 'CUDA init error');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(13, 'TRACE_PROCESS_EVENT_CUDA_EGL_DRIVER', 'CUDA EGL driver');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(18, 'TRACE_PROCESS_EVENT_VSYNC', 'Vsync');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(26, 'TRACE_PROCESS_EVENT_CUDA_API', 'CUDA API');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(27, 'TRACE_PROCESS_EVENT_OS_RUNTIME', 'OSRT runtime');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(28, 'TRACE_PROCESS_EVENT_CUDNN', 'cuDNN');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(29, 'TRACE_PROCESS_EVENT_CUBLAS', 'cuBLAS');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(31, 'TRACE_PROCESS_EVENT_OS_RUNTIME_START', 'OSRT start');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(32, 'TRACE_PROCESS_EVENT_OS_RUNTIME_FINISH', 'OSRT finish');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(33, 'TRACE_PROCESS_EVENT_CUDNN_START', 'cuDNN start');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(34, 'TRACE_PROCESS_EVENT_CUDNN_FINISH', 'cuDNN finish');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(35, 'TRACE_PROCESS_EVENT_CUBLAS_START', 'cuBLAS start');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(36, 'TRACE_PROCESS_EVENT_CUBLAS_FINISH', 'cuBLAS finish');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(37, 'TRACE_PROCESS_EVENT_THREAD_BLOCK', 'Thread block');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(38, 'TRACE_PROCESS_EVENT_NVMEDIA', 'NVmedia');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(39, 'TRACE_PROCESS_EVENT_NVMEDIA_START', 'NVmedia start');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(40, 'TRACE_PROCESS_EVENT_NVMEDIA_FINISH', 'NVmedia finish');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(41, 'TRACE_PROCESS_EVENT_DX12_API', 'DX12 API');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(42, 'TRACE_PROCESS_EVENT_DX12_WORKLOAD', 'DX12 workload');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(43, 'TRACE_PROCESS_EVENT_DX12_START', 'DX12 start');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(44, 'TRACE_PROCESS_EVENT_DX12_FINISH', 'DX12 finish');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(45, 'TRACE_PROCESS_EVENT_OPENACC_START', 'OpenACC start');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(46, 'TRACE_PROCESS_EVENT_OPENACC_FINISH', 'OpenACC finish');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(47, 'TRACE_PROCESS_EVENT_OPENACC_INIT_ERROR', 'OpenACC init error');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(48, 'TRACE_PROCESS_EVENT_OPENACC', 'OpenACC');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(49, 'TRACE_PROCESS_EVENT_CPU_FPS', 'CPU FPS');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(50, 'TRACE_PROCESS_EVENT_GPU_FPS', 'GPU FPS');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(51, 'TRACE_PROCESS_EVENT_GL_MULTI_ERROR', 'GL multi-error');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(52, 'TRACE_PROCESS_EVENT_DX12_DISPLAY', 'DX12 display');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(53, 'TRACE_PROCESS_EVENT_VULKAN_API', 'Vulkan API');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(54, 'TRACE_PROCESS_EVENT_VULKAN_WORKLOAD', 'Vulkan workload');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(55, 'TRACE_PROCESS_EVENT_VULKAN_START', 'Vulkan start');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(56, 'TRACE_PROCESS_EVENT_VULKAN_FINISH', 'Vulkan finish');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(57, 'TRACE_PROCESS_EVENT_SYSTEM_EVENT', 'System event');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(58, 'TRACE_PROCESS_EVENT_GPU_MEMORY', 'GPU memory');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(59, 'TRACE_PROCESS_EVENT_DX12_CREATE_OBJECT', 'DX12 create object');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(60, 'TRACE_PROCESS_EVENT_VULKAN_CREATE_OBJECT', 'Vulkan create object');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(61, 'TRACE_PROCESS_EVENT_CUSTOM_ETW_TRACE', 'Custom ETW trace');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(62, 'TRACE_PROCESS_EVENT_SLI', 'SLI');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(63, 'TRACE_PROCESS_EVENT_SLI_START', 'SLI start');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(64, 'TRACE_PROCESS_EVENT_SLI_FINISH', 'SLI finish');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(65, 'TRACE_PROCESS_EVENT_DX12_DEBUG_API', 'DX12 debug API');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(66, 'TRACE_PROCESS_EVENT_VULKAN_DEBUG_API', 'Vulkan debug API');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(67, 'TRACE_PROCESS_EVENT_CUDABACKTRACE', 'CUDA backtrace');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(68, 'TRACE_PROCESS_EVENT_CUDABACKTRACE_START', 'CUDA backtrace start');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(69, 'TRACE_PROCESS_EVENT_CUDABACKTRACE_FINISH', 'CUDA backtrace finish');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(70, 'TRACE_PROCESS_EVENT_WDDM', 'WDDM');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(71, 'TRACE_PROCESS_EVENT_DX11_API', 'DX11 API');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(72, 'TRACE_PROCESS_EVENT_DX11_START', 'DX11 start');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(73, 'TRACE_PROCESS_EVENT_DX11_FINISH', 'DX11 finish');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(74, 'TRACE_PROCESS_EVENT_DX11_CREATE_OBJECT', 'DX11 create object');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(75, 'TRACE_PROCESS_EVENT_DX11_DEBUG_API', 'DX11 debug API');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(76, 'TRACE_PROCESS_EVENT_DXCOMMON_API', 'DX common API');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(77, 'TRACE_PROCESS_EVENT_CUDA_GRAPH_NODE_CREATION', 'CUDA graph node creation');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(78, 'TRACE_PROCESS_EVENT_OPENMP', 'OpenMP');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(79, 'TRACE_PROCESS_EVENT_OPENMP_START', 'OpenMP start');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(80, 'TRACE_PROCESS_EVENT_OPENMP_FINISH', 'OpenMP finish');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(81, 'TRACE_PROCESS_EVENT_NVAPI', 'NV API');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(82, 'TRACE_PROCESS_EVENT_ETWDXGKRNL', 'ETW DXG KRNL');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(83, 'TRACE_PROCESS_EVENT_NVENC', 'NVENC');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(84, 'TRACE_PROCESS_EVENT_NVENC_START', 'NVENC start');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(85, 'TRACE_PROCESS_EVENT_NVENC_FINISH', 'NVENC finish');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(86, 'TRACE_PROCESS_EVENT_NVDEC', 'NVDEC');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(87, 'TRACE_PROCESS_EVENT_NVDEC_START', 'NVDEC start');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(88, 'TRACE_PROCESS_EVENT_NVDEC_FINISH', 'NVDEC finish');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(89, 'TRACE_PROCESS_EVENT_NVJPEG', 'nvJPEG');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(90, 'TRACE_PROCESS_EVENT_NVJPEG_START', 'nvJPEG start');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(91, 'TRACE_PROCESS_EVENT_NVJPEG_FINISH', 'nvJPEG finish');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(92, 'TRACE_PROCESS_EVENT_DX12_BATCH_WORKLOAD', 'DX12 batch workload');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(93, 'TRACE_PROCESS_EVENT_VULKAN_BATCH_WORKLOAD', 'Vulkan batch workload');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(94, 'TRACE_PROCESS_EVENT_CUDA_GRAPHEXEC_CREATION', 'CUDA graph exec creation');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(95, 'TRACE_PROCESS_EVENT_CUDA_GRAPH_CREATION', 'CUDA graph creation');
INSERT INTO ENUM_NSYS_EVENT_CLASS VALUES(96, 'TRACE_PROCESS_EVENT_CUDA_GRAPH_CLONE', 'CUDA graph clone');
INSERT INTO ENUM_CUDA_KERNEL_LAUNCH_TYPE VALUES(0, 'CUDA_KERNEL_LAUNCH_TYPE_UNKNOWN', 'Unknown');
INSERT INTO ENUM_CUDA_KERNEL_LAUNCH_TYPE VALUES(1, 'CUDA_KERNEL_LAUNCH_TYPE_REGULAR', 'Regular');
INSERT INTO ENUM_CUDA_KERNEL_LAUNCH_TYPE VALUES(2, 'CUDA_KERNEL_LAUNCH_TYPE_COOPERATIVE_SINGLE_DEVICE', 'Coop Single Device');
INSERT INTO ENUM_CUDA_KERNEL_LAUNCH_TYPE VALUES(3, 'CUDA_KERNEL_LAUNCH_TYPE_COOPERATIVE_MULTI_DEVICE', 'Coop Multi Device');
INSERT INTO ENUM_CUDA_FUNC_CACHE_CONFIG VALUES(0, 'CU_FUNC_CACHE_PREFER_NONE', 'None');
INSERT INTO ENUM_CUDA_FUNC_CACHE_CONFIG VALUES(1, 'CU_FUNC_CACHE_PREFER_SHARED', 'Shared');
INSERT INTO ENUM_CUDA_FUNC_CACHE_CONFIG VALUES(2, 'CU_FUNC_CACHE_PREFER_L1', 'L1');
INSERT INTO ENUM_CUDA_FUNC_CACHE_CONFIG VALUES(3, 'CU_FUNC_CACHE_PREFER_EQUAL', 'Equal');
INSERT INTO ENUM_CUDA_SHARED_MEM_LIMIT_CONFIG VALUES(0, 'CUDA_SHARED_MEM_LIMIT_DEFAULT', 'Default');
INSERT INTO ENUM_CUDA_SHARED_MEM_LIMIT_CONFIG VALUES(1, 'CUDA_SHARED_MEM_LIMIT_OPTIN', 'Opt in');
