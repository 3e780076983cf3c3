// Package podsigner is a Kubernetes signer of pod certificates
// (certificates.k8s.io/v1 PodCertificateRequest, KEP-4317) in a source
// cluster: the kubelet makes a key that never leaves the node and asks,
// for a Pod whose podCertificate projected volume names this signer, for a
// certificate; the signer answers with one naming the Pod's ServiceAccount
// as the workload identity
//
//	spiffe://<trust domain>/cluster/<cluster>/ns/<namespace>/sa/<serviceAccount>
//
// signed by the cluster's CA (pki.SignPodCertificate), and nothing else:
// no other name, no CA bit, client authentication only.
//
// Which workloads may have one is the source cluster's choice: a
// ServiceAccount labelled LabelPodCertificates=true. A request is checked
// against the live objects before it is signed, whoever created it: its
// Pod must exist under the request's UID, run as the request's
// ServiceAccount (under its UID), be on the request's node and have a
// podCertificate volume for this signer. The API server's NodeRestriction
// admission checks the same of a kubelet's requests. Anyone else allowed
// to create requests (by default only cluster administrators) is held to
// it here, but can still ask, with a key of its own, for any such Pod's
// certificate: that permission is as good as the Pod's identity.
package podsigner

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"
	certificatesv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/clock"

	"github.com/tokenbroker/tokenbroker/pki"
)

// LabelPodCertificates on a ServiceAccount, "true", lets its Pods have a
// pod certificate from this signer.
const LabelPodCertificates = "tokenbroker.io/pod-certificates"

const (
	// MinLifetime is the shortest certificate the API accepts.
	MinLifetime = time.Hour
	// DefaultMaxLifetime bounds the certificates unless Config says less:
	// the kubelet's default ask, 24 hours.
	DefaultMaxLifetime = 24 * time.Hour
)

// The reasons of a Denied or Failed condition.
const (
	ReasonPodNotFound      = "PodNotFound"
	ReasonPodMismatch      = "PodMismatch"
	ReasonNotRequested     = "PodAsksForNoCertificate"
	ReasonNotAllowed       = "ServiceAccountNotAllowed"
	ReasonNoPublicKey      = "NoPublicKey"
	ReasonLifetime         = "LifetimeNotSignable"
	reasonIssued           = "Issued"
	conditionMessageMaxLen = 1024
)

// errNoCA is why a request waits: the cluster has no CA yet (the agent
// has not enrolled with one).
var errNoCA = errors.New("the cluster has no CA yet: the agent has not enrolled with one")

// Config is what a Signer needs.
type Config struct {
	Client kubernetes.Interface
	// SignerName is the signer name the Pods' podCertificate volumes
	// ask for; requests for any other are not this signer's.
	SignerName string
	// CA returns the cluster's CA in force (the cluster CA the agent
	// received at enrollment, replaced at each renewal), or nil while
	// there is none: requests then wait, retried with backoff.
	// ClusterIdentity is the cluster it signs for.
	CA              func() *pki.CA
	ClusterIdentity string
	// MaxLifetime bounds every certificate (DefaultMaxLifetime when 0,
	// at least MinLifetime); a request may ask for less.
	MaxLifetime time.Duration
	Clock       clock.PassiveClock
	Logger      *zap.Logger
}

// Signer signs the PodCertificateRequests of one signer name.
type Signer struct {
	cfg Config
}

// New checks cfg and returns its Signer.
func New(cfg Config) (*Signer, error) {
	if cfg.Client == nil || cfg.CA == nil || cfg.SignerName == "" {
		return nil, errors.New("pod signer: a client, a signer name and a CA are required")
	}
	if _, _, err := pki.ParseIdentity(cfg.ClusterIdentity); err != nil {
		return nil, fmt.Errorf("pod signer: %w", err)
	}
	if cfg.MaxLifetime == 0 {
		cfg.MaxLifetime = DefaultMaxLifetime
	}
	if cfg.MaxLifetime < MinLifetime {
		return nil, fmt.Errorf("pod signer: a maximum lifetime of %s is under the API's minimum of %s", cfg.MaxLifetime, MinLifetime)
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.Logger == nil {
		cfg.Logger = zap.NewNop()
	}
	return &Signer{cfg: cfg}, nil
}

// Run watches the requests for the signer's name and answers each until
// ctx ends. A request whose answer could not be written (the API server
// unavailable, a conflict) is tried again, backing off.
func (s *Signer) Run(ctx context.Context) {
	f := informers.NewSharedInformerFactoryWithOptions(s.cfg.Client, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("spec.signerName", s.cfg.SignerName).String()
	}))
	inf := f.Certificates().V1().PodCertificateRequests()
	queue := workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[string](),
		workqueue.TypedRateLimitingQueueConfig[string]{Name: "pod-signer"})
	enqueue := func(obj any) {
		if key, err := cache.MetaNamespaceKeyFunc(obj); err == nil {
			queue.Add(key)
		}
	}
	_, _ = inf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    enqueue,
		UpdateFunc: func(_, obj any) { enqueue(obj) },
	})
	f.Start(ctx.Done())
	go func() {
		<-ctx.Done()
		queue.ShutDown()
	}()
	if !cache.WaitForCacheSync(ctx.Done(), inf.Informer().HasSynced) {
		return
	}
	lister := inf.Lister()
	for {
		key, quit := queue.Get()
		if quit {
			f.Shutdown()
			return
		}
		ns, name, _ := cache.SplitMetaNamespaceKey(key)
		err := func() error {
			pcr, err := lister.PodCertificateRequests(ns).Get(name)
			if apierrors.IsNotFound(err) {
				return nil
			}
			if err != nil {
				return err
			}
			return s.Answer(ctx, pcr)
		}()
		if err != nil {
			s.cfg.Logger.Warn("pod signer: answering a request failed; retrying", zap.String("request", key), zap.Error(err))
			queue.AddRateLimited(key)
		} else {
			queue.Forget(key)
		}
		queue.Done(key)
	}
}

// Answer signs pcr, or denies it, and writes the answer to its status. A
// request already answered (by this signer or another replica) is left
// alone; an error means the answer was not written and may be tried
// again.
func (s *Signer) Answer(ctx context.Context, pcr *certificatesv1.PodCertificateRequest) error {
	if pcr.Spec.SignerName != s.cfg.SignerName || answered(pcr) {
		return nil
	}
	status, err := s.decide(ctx, pcr)
	if err != nil {
		return err
	}
	out := pcr.DeepCopy()
	out.Status = status
	_, err = s.cfg.Client.CertificatesV1().PodCertificateRequests(pcr.Namespace).UpdateStatus(ctx, out, metav1.UpdateOptions{})
	if err != nil {
		return fmt.Errorf("write the answer to %s/%s: %w", pcr.Namespace, pcr.Name, err)
	}
	c := status.Conditions[0]
	s.cfg.Logger.Info("pod certificate request answered", zap.String("request", pcr.Namespace+"/"+pcr.Name),
		zap.String("pod", pcr.Namespace+"/"+pcr.Spec.PodName), zap.String("service_account", pcr.Spec.ServiceAccountName),
		zap.String("answer", c.Type), zap.String("reason", c.Reason))
	return nil
}

// answered reports whether pcr carries a final condition: Issued, Denied
// or Failed (the API server keeps a status that has one unchanged).
func answered(pcr *certificatesv1.PodCertificateRequest) bool {
	for _, c := range pcr.Status.Conditions {
		switch c.Type {
		case certificatesv1.PodCertificateRequestConditionTypeIssued, certificatesv1.PodCertificateRequestConditionTypeDenied,
			certificatesv1.PodCertificateRequestConditionTypeFailed:
			return true
		}
	}
	return false
}

// decide is the answer to pcr: a signed certificate, or a Denied (not
// this signer's to grant) or Failed (it cannot sign that) condition. An
// error is a failure to read what the answer depends on.
func (s *Signer) decide(ctx context.Context, pcr *certificatesv1.PodCertificateRequest) (certificatesv1.PodCertificateRequestStatus, error) {
	spec := pcr.Spec
	now := s.cfg.Clock.Now().Truncate(time.Second)
	// ends makes the answer of a final condition of type typ.
	ends := func(typ string) func(reason, format string, args ...any) (certificatesv1.PodCertificateRequestStatus, error) {
		return func(reason, format string, args ...any) (certificatesv1.PodCertificateRequestStatus, error) {
			return final(typ, reason, fmt.Sprintf(format, args...), now, pcr.Generation), nil
		}
	}
	deny, fail := ends(certificatesv1.PodCertificateRequestConditionTypeDenied), ends(certificatesv1.PodCertificateRequestConditionTypeFailed)
	pod, err := s.cfg.Client.CoreV1().Pods(pcr.Namespace).Get(ctx, spec.PodName, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return deny(ReasonPodNotFound, "Pod %s/%s does not exist", pcr.Namespace, spec.PodName)
	case err != nil:
		return certificatesv1.PodCertificateRequestStatus{}, fmt.Errorf("read Pod %s/%s: %w", pcr.Namespace, spec.PodName, err)
	case pod.UID != spec.PodUID || pod.Spec.ServiceAccountName != spec.ServiceAccountName || string(spec.NodeName) != pod.Spec.NodeName:
		return deny(ReasonPodMismatch, "the request's Pod, ServiceAccount or node is not Pod %s/%s as it runs", pcr.Namespace, spec.PodName)
	case !asksFor(pod, s.cfg.SignerName):
		return deny(ReasonNotRequested, "Pod %s/%s has no podCertificate volume for %s", pcr.Namespace, spec.PodName, s.cfg.SignerName)
	case len(spec.UnverifiedUserAnnotations) > 0:
		return deny(certificatesv1.PodCertificateRequestConditionInvalidUserConfig, "this signer reads no user annotations; the Pod's podCertificate volume must set none")
	}
	sa, err := s.cfg.Client.CoreV1().ServiceAccounts(pcr.Namespace).Get(ctx, spec.ServiceAccountName, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return deny(ReasonPodMismatch, "ServiceAccount %s/%s does not exist", pcr.Namespace, spec.ServiceAccountName)
	case err != nil:
		return certificatesv1.PodCertificateRequestStatus{}, fmt.Errorf("read ServiceAccount %s/%s: %w", pcr.Namespace, spec.ServiceAccountName, err)
	case sa.UID != spec.ServiceAccountUID:
		return deny(ReasonPodMismatch, "ServiceAccount %s/%s is not the one the request names (UID)", pcr.Namespace, spec.ServiceAccountName)
	case !allowed(sa):
		return deny(ReasonNotAllowed, "ServiceAccount %s/%s is not labelled %s=true: its Pods get no certificate from %s", pcr.Namespace, sa.Name, LabelPodCertificates, s.cfg.SignerName)
	}
	if len(spec.StubPKCS10Request) == 0 {
		return fail(ReasonNoPublicKey, "the request has no stubPKCS10Request: this signer reads the key from it (certificates.k8s.io/v1)")
	}
	// The API server checked the stub request's signature and key type.
	csr, err := x509.ParseCertificateRequest(spec.StubPKCS10Request)
	if err != nil {
		return fail(ReasonNoPublicKey, "the stubPKCS10Request does not parse: %v", err)
	}
	ca := s.cfg.CA()
	if ca == nil {
		return certificatesv1.PodCertificateRequestStatus{}, errNoCA
	}
	lifetime := s.cfg.MaxLifetime
	if m := spec.MaxExpirationSeconds; m != nil && time.Duration(*m)*time.Second < lifetime {
		lifetime = time.Duration(*m) * time.Second
	}
	notBefore := now.Add(-pki.PodCertificateBackdate)
	notAfter := notBefore.Add(lifetime)
	if caEnd := ca.Certificate().NotAfter.Truncate(time.Second); notAfter.After(caEnd) {
		notAfter = caEnd
	}
	if notAfter.Sub(notBefore) < MinLifetime {
		return fail(ReasonLifetime, "the signer's CA expires at %s: it cannot sign the %s the API requires at least", ca.Certificate().NotAfter.UTC().Format(time.RFC3339), MinLifetime)
	}
	id, err := pki.WorkloadIdentity(s.cfg.ClusterIdentity, pcr.Namespace, spec.ServiceAccountName)
	if err != nil {
		return fail(ReasonPodMismatch, "no workload identity for %s/%s: %v", pcr.Namespace, spec.ServiceAccountName, err)
	}
	_, chain, err := ca.SignPodCertificate(s.cfg.ClusterIdentity, pki.PodCertificate{
		Identity: id, PublicKey: csr.PublicKey, NotBefore: notBefore, NotAfter: notAfter,
		PodName: spec.PodName, PodUID: string(spec.PodUID),
	})
	if err != nil {
		return certificatesv1.PodCertificateRequestStatus{}, fmt.Errorf("sign %s: %w", id, err)
	}
	// Refresh at half the lifetime: the API wants it at least ten
	// minutes from either end, which a lifetime of an hour or more allows.
	refresh := notBefore.Add(notAfter.Sub(notBefore) / 2).Truncate(time.Second)
	st := final(certificatesv1.PodCertificateRequestConditionTypeIssued, reasonIssued, "signed for "+id, now, pcr.Generation)
	st.CertificateChain = string(chain)
	st.NotBefore, st.BeginRefreshAt, st.NotAfter = ptrTime(notBefore), ptrTime(refresh), ptrTime(notAfter)
	return st, nil
}

func allowed(sa *corev1.ServiceAccount) bool { return sa.Labels[LabelPodCertificates] == "true" }

// asksFor reports whether pod has a podCertificate projected volume for
// signerName: a request for a Pod that asks for none is not the kubelet's
// (the API server's NodeRestriction refuses a kubelet's request for a Pod
// without one, from 1.37), and is denied whoever made it.
func asksFor(pod *corev1.Pod, signerName string) bool {
	for _, v := range pod.Spec.Volumes {
		if v.Projected == nil {
			continue
		}
		for _, src := range v.Projected.Sources {
			if src.PodCertificate != nil && src.PodCertificate.SignerName == signerName {
				return true
			}
		}
	}
	return false
}

// final is a status of the one final condition typ.
func final(typ, reason, message string, now time.Time, generation int64) certificatesv1.PodCertificateRequestStatus {
	if len(message) > conditionMessageMaxLen {
		message = message[:conditionMessageMaxLen]
	}
	return certificatesv1.PodCertificateRequestStatus{Conditions: []metav1.Condition{{
		Type: typ, Status: metav1.ConditionTrue, Reason: reason, Message: message,
		LastTransitionTime: metav1.NewTime(now), ObservedGeneration: generation,
	}}}
}

func ptrTime(t time.Time) *metav1.Time {
	mt := metav1.NewTime(t)
	return &mt
}
