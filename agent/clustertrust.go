package agent

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	certificatesv1 "k8s.io/api/certificates/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	certificatesv1client "k8s.io/client-go/kubernetes/typed/certificates/v1"
	"k8s.io/utils/clock"

	"github.com/tokenbroker/tokenbroker/pki"
)

// maxTrustBundles bounds the ClusterTrustBundles one read considers: a
// signer has one bundle per broker that publishes for it, a handful.
const maxTrustBundles = 64

// errNoTrustYet is what a broker client gets while no ClusterTrustBundle
// has given the agent a CA; the target backs off and tries again.
var errNoTrustYet = errors.New("no broker CA from ClusterTrustBundles yet")

// trustState is a set of broker CAs in service; never modified once stored.
type trustState struct {
	pem  []byte
	pool *x509.CertPool
}

// clusterTrust keeps the broker CAs read from the signer-linked
// ClusterTrustBundles of the agent's cluster (identity.trustBundleFrom).
// The selection is by spec.signerName, checked again on every bundle read,
// because a bundle without a signer can be made by anyone allowed to create
// clustertrustbundles, while a signer-linked one needs attest on the signer.
type clusterTrust struct {
	client   certificatesv1client.ClusterTrustBundleInterface
	signer   string
	selector string
	// pin, if set, keeps only the pinned CA and CAs that chain to it.
	pin      string
	interval time.Duration
	clock    clock.Clock
	log      *zap.Logger

	cur atomic.Pointer[trustState]
}

func newClusterTrust(src ClusterTrustBundleSource, pin string, c certificatesv1client.ClusterTrustBundleInterface, clk clock.Clock, log *zap.Logger) (*clusterTrust, error) {
	sel, err := metav1.LabelSelectorAsSelector(src.LabelSelector)
	if err != nil {
		return nil, fmt.Errorf("identity.trustBundleFrom.clusterTrustBundle.labelSelector: %w", err)
	}
	return &clusterTrust{client: c, signer: src.SignerName, selector: sel.String(), pin: pin,
		interval: time.Duration(src.Interval), clock: clk,
		log: log.With(zap.String("signer", src.SignerName))}, nil
}

// get is the CAs in service, nil before the first good read.
func (t *clusterTrust) get() *trustState { return t.cur.Load() }

// run reads the bundles every interval until ctx is done.
func (t *clusterTrust) run(ctx context.Context) {
	for {
		timer := t.clock.NewTimer(t.interval)
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-timer.C():
		}
		if err := t.refresh(ctx); err != nil && ctx.Err() == nil {
			t.log.Error("reading the broker CAs from ClusterTrustBundles failed; the CAs in service stay", zap.Error(err))
		}
	}
}

// refresh reads the bundles once and puts what they yield in service. On
// an error (the API, or nothing trustworthy in the bundles) the CAs in
// service stay.
func (t *clusterTrust) refresh(ctx context.Context) error {
	list, err := t.client.List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("spec.signerName", t.signer).String(),
		LabelSelector: t.selector,
		Limit:         maxTrustBundles,
	})
	if err != nil {
		return fmt.Errorf("list ClusterTrustBundles of signer %s: %w", t.signer, err)
	}
	if list.Continue != "" {
		return fmt.Errorf("more than %d ClusterTrustBundles of signer %s: narrow identity.trustBundleFrom.clusterTrustBundle.labelSelector", maxTrustBundles, t.signer)
	}
	certs, err := selectTrust(list.Items, t.signer, t.pin, t.clock.Now(), t.log)
	if err != nil {
		return err
	}
	next := &trustState{pem: pki.EncodeCertificatesPEM(certs), pool: x509.NewCertPool()}
	for _, c := range certs {
		next.pool.AddCert(c)
	}
	if prev := t.cur.Swap(next); prev == nil || string(prev.pem) != string(next.pem) {
		fps := make([]string, 0, len(certs))
		for _, c := range certs {
			fps = append(fps, pki.Fingerprint(c))
		}
		t.log.Info("broker CAs from ClusterTrustBundles in service", zap.Strings("cas", fps), zap.Int("bundles", len(list.Items)))
	}
	return nil
}

// selectTrust is the pure part of a read: of bundles (as listed, possibly
// holding anything), only those linked to signer and named as the API
// server requires for it count; their certificates are merged
// (pki.MergeCABundles, bundles in name order), then narrowed to the pin
// when one is set. Skipped bundles are logged by name. An empty result is
// an error.
func selectTrust(bundles []certificatesv1.ClusterTrustBundle, signer, pin string, now time.Time, log *zap.Logger) ([]*x509.Certificate, error) {
	prefix := strings.ReplaceAll(signer, "/", ":") + ":"
	var names []string
	var pems [][]byte
	sorted := slices.Clone(bundles)
	slices.SortFunc(sorted, func(a, b certificatesv1.ClusterTrustBundle) int { return strings.Compare(a.Name, b.Name) })
	for _, b := range sorted {
		// The field selector already chose these; a client that ignored
		// it (or a proxy) must still not make an unsigned bundle count.
		if b.Spec.SignerName != signer || !strings.HasPrefix(b.Name, prefix) {
			log.Warn("ignoring a ClusterTrustBundle of another signer", zap.String("bundle", b.Name), zap.String("bundle_signer", b.Spec.SignerName))
			continue
		}
		names = append(names, b.Name)
		pems = append(pems, []byte(b.Spec.TrustBundle))
	}
	certs, skipped, err := pki.MergeCABundles(pems)
	if err != nil {
		return nil, err
	}
	for _, s := range skipped {
		log.Warn("ignoring a ClusterTrustBundle that is not a bundle of CA certificates", zap.Error(s), zap.Strings("bundles", names))
	}
	if pin != "" && len(certs) > 0 {
		pinned, err := pki.PinnedCAs(certs, pin, now)
		if err != nil {
			return nil, fmt.Errorf("ClusterTrustBundles of signer %s: %w (identity.enroll.caFingerprint)", signer, err)
		}
		certs = pinned
	}
	if len(certs) == 0 {
		return nil, fmt.Errorf("no CA certificate in the ClusterTrustBundles of signer %s (%d found)", signer, len(names))
	}
	return certs, nil
}
