//! The crate's own tests: version codes, the checks of `nccl_fn!`, loading errors, and (with
//! a real libnccl, `--ignored`) the library's answers.

use super::*;

#[test]
fn version_codes_follow_ncclh() {
    assert_eq!(version_code(2, 28, 9), 22809);
    assert_eq!(version_code(2, 4, 8), 2408);
    assert_eq!(version_string(22809), "2.28.9");
    assert_eq!(version_string(2408), "2.4.8");
    assert_eq!(introduced("ncclAlltoAll"), Some(22800));
    assert_eq!(introduced("nope"), None);
}

/// A `Library` over libc: every NCCL function is missing, so the checks of [`nccl_fn!`]
/// run without NCCL.
fn without_nccl(version: i32) -> Library {
    // SAFETY: libc is already loaded into this process; loading it again runs no
    // initialiser, and `from_library` only looks symbols up (none is called).
    let raw =
        unsafe { NcclLib::from_library(libloading::Library::new("libc.so.6").unwrap()) }.unwrap();
    Library {
        raw: std::mem::ManuallyDrop::new(raw),
        path: "libc.so.6".into(),
        version,
    }
}

#[test]
fn nccl_fn_checks_the_version_then_the_symbol() {
    let old = without_nccl(version_code(2, 18, 0));
    let e = nccl_fn!(&old, ncclAlltoAll).unwrap_err();
    assert!(
        matches!(
            e,
            LoadError::TooOld {
                symbol: "ncclAlltoAll",
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        "ncclAlltoAll needs NCCL 2.28.0 or newer; libc.so.6 is NCCL 2.18.0"
    );
    let new = std::sync::Arc::new(without_nccl(version_code(2, 28, 9)));
    // Through an `Arc` too, evaluated once.
    let mut evaluated = 0;
    let e = nccl_fn!(
        {
            evaluated += 1;
            &new
        },
        ncclAllReduce
    )
    .unwrap_err();
    assert_eq!(evaluated, 1);
    assert_eq!(
        e.to_string(),
        "libc.so.6 (NCCL 2.28.9) has no ncclAllReduce, which needs NCCL 2.0.0 or newer"
    );
    // The macro and `get` agree.
    let by_get = new
        .get("ncclAlltoAll", &new.raw().ncclAlltoAll)
        .unwrap_err();
    let by_macro = nccl_fn!(&new, ncclAlltoAll).unwrap_err();
    assert_eq!(by_get.to_string(), by_macro.to_string());
}

#[test]
fn introduced_is_a_const_lookup() {
    const ALL_TO_ALL: Option<i32> = introduced("ncclAlltoAll");
    assert_eq!(ALL_TO_ALL, Some(version_code(2, 28, 0)));
    assert_eq!(introduced("ncclAlltoAl"), None);
    assert_eq!(introduced("ncclAlltoAllv"), None);
    assert_eq!(introduced_or_stop("ncclSend"), version_code(2, 7, 0));
    // Every name is listed once.
    for (i, (a, _)) in INTRODUCED.iter().enumerate() {
        assert!(INTRODUCED[i + 1..].iter().all(|(b, _)| a != b), "{a} twice");
    }
}

#[test]
fn a_missing_library_names_every_path_tried() {
    // SAFETY: no file is at the path, so nothing is loaded and nothing is called.
    let e = unsafe { Library::load_from("/nonexistent/libnccl.so.2") }.unwrap_err();
    let s = e.to_string();
    assert!(matches!(e, LoadError::NotFound { .. }), "{s}");
    assert!(s.contains("/nonexistent/libnccl.so.2"), "{s}");
}

#[test]
fn a_library_that_is_not_nccl_is_unusable() {
    // SAFETY: `load_from`'s second case: libc is already loaded into this process (std
    // links it), so loading it again runs no initialiser, and it exports no
    // ncclGetVersion, so it is refused and no function of it is called.
    let e = unsafe { Library::load_from("libc.so.6") }.unwrap_err();
    assert!(matches!(e, LoadError::Unusable { .. }), "{e}");
    assert!(e.to_string().contains("no ncclGetVersion"), "{e}");
}

/// Against the real library named by `DIST_NCCL_LIBRARY` (`.ci/run` points it at the
/// nvidia-nccl-cu12 wheel's `libnccl.so.2`, which loads without a GPU). Ignored by default,
/// so that without a library it is reported as ignored, never as passed (before, it printed
/// "skipped" and passed); `cargo xtask test` runs it with `--ignored` when the variable is
/// set, and then it fails if the library is missing or wrong.
#[test]
#[ignore = "needs a real libnccl: set DIST_NCCL_LIBRARY and run with --ignored"]
fn real_library_reports_version_errors_and_ids() {
    let path = std::env::var_os("DIST_NCCL_LIBRARY")
        .expect("DIST_NCCL_LIBRARY names the libnccl.so.2 to test against");
    // SAFETY: the variable names an NCCL library (the operator's contract, here `.ci/run`'s
    // wheel); this test exists to check that library.
    let lib = unsafe { Library::load_from(&path) }.unwrap_or_else(|e| panic!("{e}"));
    assert!(lib.version() >= version_code(2, 28, 0), "{lib:?}");
    let err = nccl_fn!(&lib, ncclGetErrorString).unwrap();
    // SAFETY: ncclGetErrorString returns a static C string for any result code.
    let text = unsafe { std::ffi::CStr::from_ptr(err(ncclResult_t::ncclInvalidArgument)) };
    assert!(
        text.to_string_lossy().contains("invalid argument"),
        "{text:?}"
    );
    let last = nccl_fn!(&lib, ncclGetLastError).unwrap();
    // SAFETY: ncclGetLastError takes a communicator or null and returns a C string NCCL
    // owns (possibly empty), valid until the next NCCL call on this thread; it is read
    // before any other.
    let p = unsafe { last(std::ptr::null_mut()) };
    assert!(!p.is_null(), "ncclGetLastError returned null");
    // SAFETY: non-null and NUL-terminated, as above.
    let _ = unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy();
    // Recovery's functions, each exported where its version promises it (nothing called).
    let v = lib.version();
    assert_eq!(
        nccl_fn!(&lib, ncclCommShrink).is_ok(),
        v >= version_code(2, 27, 0)
    );
    assert_eq!(
        nccl_fn!(&lib, ncclCommRevoke).is_ok(),
        v >= version_code(2, 28, 0)
    );
    assert_eq!(
        nccl_fn!(&lib, ncclCommGrow).is_ok(),
        v >= version_code(2, 29, 0)
    );
    let get_id = nccl_fn!(&lib, ncclGetUniqueId).unwrap();
    let mut id = ncclUniqueId::default();
    // SAFETY: the pointer is valid for one ncclUniqueId.
    let r = unsafe { get_id(&mut id) };
    assert_eq!(r, ncclResult_t::ncclSuccess);
    assert!(id.internal.iter().any(|b| *b != 0), "an all-zero unique id");
    let too_new = lib.limited_to(version_code(2, 18, 0));
    assert!(
        too_new.path().ends_with("limited to 2.18.0)"),
        "{too_new:?}"
    );
    let e = nccl_fn!(&too_new, ncclAlltoAll).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "ncclAlltoAll needs NCCL 2.28.0 or newer; {} is NCCL 2.18.0",
            too_new.path()
        )
    );
    assert!(matches!(
        nccl_fn!(&too_new, ncclCommRevoke),
        Err(LoadError::TooOld {
            symbol: "ncclCommRevoke",
            ..
        })
    ));
}

#[test]
fn enum_values_match_the_header() {
    assert_eq!(ncclResult_t::ncclInProgress.0, 7);
    assert_eq!(ncclDataType_t::ncclBfloat16.0, 9);
    assert_eq!(ncclDataType_t::ncclFloat8e5m2.0, 11);
    assert_eq!(ncclRedOp_t::ncclAvg.0, 4);
    assert_eq!(std::mem::size_of::<ncclUniqueId>(), 128);
}

/// The functions recovery uses are checked against the versions that introduced them: shrink
/// from 2.27, revoke from 2.28, grow and its per-communicator id from 2.29 (the real library
/// exports each one its version promises: `real_library_reports_version_errors_and_ids`).
#[test]
fn recovery_functions_need_their_versions() {
    let before_shrink = without_nccl(version_code(2, 26, 5));
    let e = nccl_fn!(&before_shrink, ncclCommShrink).unwrap_err();
    assert_eq!(
        e.to_string(),
        "ncclCommShrink needs NCCL 2.27.0 or newer; libc.so.6 is NCCL 2.26.5"
    );
    let before_grow = without_nccl(version_code(2, 28, 9));
    assert!(matches!(
        nccl_fn!(&before_grow, ncclCommGrow),
        Err(LoadError::TooOld {
            symbol: "ncclCommGrow",
            ..
        })
    ));
    assert!(matches!(
        nccl_fn!(&before_grow, ncclCommGetUniqueId),
        Err(LoadError::TooOld { .. })
    ));
    // Revoke is new enough there, but libc has no such symbol.
    assert!(matches!(
        nccl_fn!(&before_grow, ncclCommRevoke),
        Err(LoadError::MissingSymbol {
            symbol: "ncclCommRevoke",
            ..
        })
    ));
}

/// A library limited to an older version refuses what that version lacks, naming both
/// versions, and is never taken for newer than it says.
#[test]
fn a_limited_library_refuses_what_the_older_version_lacks() {
    let lib = without_nccl(version_code(2, 29, 2)).limited_to(version_code(2, 27, 3));
    assert_eq!(lib.version(), version_code(2, 27, 3));
    let e = nccl_fn!(&lib, ncclCommRevoke).unwrap_err();
    assert_eq!(
        e.to_string(),
        "ncclCommRevoke needs NCCL 2.28.0 or newer; libc.so.6 (NCCL 2.29.2 limited to 2.27.3) \
         is NCCL 2.27.3"
    );
    let e = nccl_fn!(&lib, ncclCommGrow).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("ncclCommGrow needs NCCL 2.29.0 or newer; "),
        "{e}"
    );
    // Shrink is new enough at 2.27.3: the check goes on to the symbol (libc has none).
    assert!(matches!(
        nccl_fn!(&lib, ncclCommShrink),
        Err(LoadError::MissingSymbol {
            symbol: "ncclCommShrink",
            ..
        })
    ));
    // Never newer than it says: a higher limit changes nothing.
    let same = without_nccl(version_code(2, 26, 0)).limited_to(version_code(2, 29, 0));
    assert_eq!(same.version(), version_code(2, 26, 0));
    assert_eq!(same.path(), "libc.so.6");
    assert!(matches!(
        nccl_fn!(&same, ncclCommShrink),
        Err(LoadError::TooOld { .. })
    ));
}
