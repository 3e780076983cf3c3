package testcluster

import (
	"errors"
	"fmt"
	"time"
)

// DefaultServiceAccountIssuer is the --service-account-issuer of a cluster
// unless WithServiceAccountIssuer says otherwise. It is also the default API
// audience, as on most real clusters.
const DefaultServiceAccountIssuer = "https://kubernetes.default.svc.cluster.local"

// DefaultControllers returns the kube-controller-manager controllers started
// by WithControllerManager when it is given none: "*", those a real
// cluster runs (kube-controller-manager's own default set). Among them: CSR
// signing, approving and cleanup; the garbage collector (which deletes a
// client certificate's RoleBinding with the lease that owns it);
// clusterrole-aggregation (without it the view, edit and admin ClusterRoles
// have no rules); the namespace controller (which finalizes a deleted
// namespace); the serviceaccount controller and the root CA publisher
// (which give every namespace its default ServiceAccount and
// kube-root-ca.crt); and, with a node, the node lifecycle controller.
func DefaultControllers() []string {
	return []string{"*"}
}

const (
	defaultStartTimeout = 60 * time.Second
	defaultStopTimeout  = 15 * time.Second
)

// Option changes how a cluster is started.
type Option func(*options)

type options struct {
	binDir               string
	maxTokenExpiration   time.Duration
	issuer               string
	audiences            []string
	controllerManager    bool
	controllers          []string
	node                 bool
	streamingIdleTimeout time.Duration
	etcdFsync            bool
	profiling            bool
	apiServerArgs        []string
	auditPolicy          string
	minRequestTimeout    time.Duration
	startTimeout         time.Duration
	stopTimeout          time.Duration
}

// minMaxTokenExpiration is the smallest --service-account-max-token-expiration
// the API server starts with.
const minMaxTokenExpiration = time.Hour

func (o *options) validate() error {
	if o.maxTokenExpiration != 0 && o.maxTokenExpiration < minMaxTokenExpiration {
		return fmt.Errorf("max token expiration %s is below the API server's minimum of %s", o.maxTokenExpiration, minMaxTokenExpiration)
	}
	if o.minRequestTimeout != 0 && (o.minRequestTimeout < time.Second || o.minRequestTimeout%time.Second != 0) {
		return fmt.Errorf("min request timeout %s is not a whole number of seconds of at least 1s", o.minRequestTimeout)
	}
	if o.streamingIdleTimeout != 0 && (!o.node || o.streamingIdleTimeout < time.Second) {
		return fmt.Errorf("streaming idle timeout %s: only with a node, and at least 1s", o.streamingIdleTimeout)
	}
	if o.startTimeout <= 0 || o.stopTimeout <= 0 {
		return errors.New("start and stop timeouts must be positive")
	}
	return nil
}

func newOptions(opts []Option) options {
	o := options{
		issuer:       DefaultServiceAccountIssuer,
		startTimeout: defaultStartTimeout,
		stopTimeout:  defaultStopTimeout,
	}
	for _, opt := range opts {
		opt(&o)
	}
	if len(o.audiences) == 0 {
		o.audiences = []string{o.issuer}
	}
	return o
}

// WithBinDir makes the cluster take (and, if missing, build) its binaries in
// dir instead of $TOKENBROKER_BIN_DIR or the repository's bin/ directory.
func WithBinDir(dir string) Option {
	return func(o *options) { o.binDir = dir }
}

// WithMaxTokenExpiration sets --service-account-max-token-expiration, the cap
// the API server applies to the expirationSeconds of a TokenRequest. Tests
// use it to see the API server shorten a token (e.g. a 1h cap). The API
// server accepts only 1h to 2^32s; Run rejects other values up front. (The
// API server's other bound, a 10 minute minimum per TokenRequest, applies
// whatever this says.)
func WithMaxTokenExpiration(d time.Duration) Option {
	return func(o *options) { o.maxTokenExpiration = d }
}

// WithServiceAccountIssuer sets --service-account-issuer (the iss claim of
// service account tokens). The default is DefaultServiceAccountIssuer.
func WithServiceAccountIssuer(issuer string) Option {
	return func(o *options) { o.issuer = issuer }
}

// WithAPIAudiences sets --api-audiences, the audiences the API server accepts
// and puts in tokens requested without audiences. The default is the issuer.
func WithAPIAudiences(audiences ...string) Option {
	return func(o *options) { o.audiences = append([]string(nil), audiences...) }
}

// WithEtcdFsync makes etcd fsync its log on every write, as a production
// etcd does; by default it does not (test data is thrown away), so a write
// costs CPU only. Benchmarks use it to see what a write costs on a disk.
func WithEtcdFsync() Option {
	return func(o *options) { o.etcdFsync = true }
}

// WithProfiling serves the kube-apiserver's /debug/pprof (off by default:
// tests do not need it), for benchmarks that profile it.
func WithProfiling() Option {
	return func(o *options) { o.profiling = true }
}

// WithControllerManager also starts a kube-controller-manager that runs the
// given controllers, DefaultControllers() (those of a real cluster) when
// none are given; a test that wants fewer names them. It signs CertificateSigningRequests with the cluster
// CA, so the client certificates it issues authenticate to the cluster.
func WithControllerManager(controllers ...string) Option {
	return func(o *options) {
		o.controllerManager = true
		o.controllers = append([]string(nil), controllers...)
	}
}

// WithNode also starts a node (Cluster.Node): a kubelet built from the
// harness's Kubernetes release, with containerd and runc from the host's
// packages, and a kube-scheduler, so that Pods run and exec, attach and
// port-forward work. It implies WithControllerManager. The node's images
// are imported, never pulled: NodeImageRef is the pod sandbox, and
// Node.ImportImage brings others. It needs root, containerd, runc, ctr,
// iproute2's ip and the CNI plugins (Debian: containerd runc iproute2
// containernetworking-plugins); Run says which one is missing.
func WithNode() Option {
	return func(o *options) {
		o.node = true
		o.controllerManager = true
	}
}

// WithStreamingIdleTimeout sets the node's kubelet
// streamingConnectionIdleTimeout: how long an exec, attach or port-forward
// stream may be idle before the kubelet ends it
// (DefaultStreamingIdleTimeout, 4h, unless set). Only with WithNode.
func WithStreamingIdleTimeout(d time.Duration) Option {
	return func(o *options) { o.streamingIdleTimeout = d }
}

// WithMinRequestTimeout sets --min-request-timeout, which bounds how long
// the API server keeps a watch open: it ends each watch after a random time
// between d and 2d (1800s by default). A watch is authenticated when it
// starts, so this is also how long a watch opened with a since-revoked
// token can go on delivering events. Whole seconds, at least 1s.
func WithMinRequestTimeout(d time.Duration) Option {
	return func(o *options) { o.minRequestTimeout = d }
}

// WithAPIServerArgs appends flags to the kube-apiserver command line. They
// come after the harness's own flags, so for single-valued flags they win.
func WithAPIServerArgs(args ...string) Option {
	return func(o *options) { o.apiServerArgs = append(o.apiServerArgs, args...) }
}

// WithAuditPolicy turns on the API server's audit log: policy (an
// audit.k8s.io/v1 Policy document) is written to the cluster's directory as
// --audit-policy-file, and the events go as JSON lines to AuditLogPath, in
// the blocking mode (the default, named here): an event is on disk before
// its response is sent, so a test reads every request it has made.
func WithAuditPolicy(pol string) Option {
	return func(o *options) { o.auditPolicy = pol }
}

// WithStartTimeout bounds how long Run waits for the cluster to become ready
// (60s by default). It does not include building missing binaries.
func WithStartTimeout(d time.Duration) Option {
	return func(o *options) { o.startTimeout = d }
}

// WithStopTimeout bounds how long a child process is given to exit after
// SIGTERM before it is killed (15s by default).
func WithStopTimeout(d time.Duration) Option {
	return func(o *options) { o.stopTimeout = d }
}
